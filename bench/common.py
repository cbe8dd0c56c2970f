"""What every benchmark shares: one way to start and stop the servers it measures (aotx,
llama-server, the thin server), and the engine alone on the embedded model.

* :func:`aotx` serves from a fresh state folder (a models file, extra ``serve`` flags, a
  Python and environment of choice, from another checkout with ``cwd``) and returns a
  :class:`Server` once ``/readyz`` answers; :meth:`Server.stop` ends its process group
  and removes its state folder.  :func:`serving` is the same as a context manager.
* :func:`peer` starts llama-server (``LLAMA_SERVER``: a binary, or the URL of one
  running) at its defaults (``-t 2``) or with aotx's slot count; :func:`thin` the same
  engine behind the thinnest server (``thin_server.py``).
* :func:`engine` is a ``LlamaEngine`` on the embedded model; :func:`model` the model as
  the device loads it (the llama.cpp factory: engine, scheduler, embeddings), for
  measuring the engine without a server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from aotx.engine.llama.engine import LlamaEngine
    from aotx.engine.load import Loaded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Server:
    """A server being measured: its process (None for one already running elsewhere),
    base URL, the admin's headers (aotx), its name in reports, its state folder."""

    proc: subprocess.Popen[bytes] | None
    url: str
    name: str = "aotx"
    headers: dict[str, str] = field(default_factory=dict)
    state_dir: str | None = None

    @property
    def state(self) -> str:
        """aotx's state folder (tokens, sockets, logs)."""
        assert self.state_dir is not None, f"{self.name} has no state folder here"
        return self.state_dir

    def cli(self, *args: str) -> str:
        """``aotx ARGS --state-dir`` this server's folder (its tokens and grants): stdout."""
        out = subprocess.run([sys.executable, "-m", "aotx", *args, "--state-dir", self.state],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout

    def mint(self, principal: str) -> str:
        """A new token of ``principal`` (its grant the default one)."""
        return self.cli("token", "create", "--principal", principal).strip().splitlines()[-1]

    def stop(self) -> None:
        """End the process group (SIGTERM, then SIGKILL after 30 s) and remove the state."""
        stop(self.proc)
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 300,
               interval: float = 0.2) -> None:
    """Until ``url`` answers 200 (asked every ``interval`` seconds); SystemExit when
    ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited while starting ({url})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise SystemExit(f"{url} not ready")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def aotx(models: str | None = None, *, args: Sequence[str] = (), python: str = sys.executable,
         env: dict[str, str] | None = None, cwd: str | None = None,
         prepare: Callable[[str], None] | None = None) -> Server:
    """``aotx serve`` from a fresh state folder with ``models`` as its models file (None:
    none, its defaults) and ``args`` added to ``serve``, run by ``python`` in ``cwd`` (a
    checkout: ``python -m aotx`` imports the package from there) with ``env`` added;
    ``prepare(state)`` runs first (to put model files there).  Its log goes to
    ``$AOTX_BENCH_LOG`` when set."""
    state = tempfile.mkdtemp(prefix="aotx-bench-", dir="/tmp")
    if models is not None:
        with open(os.path.join(state, "models.toml"), "w") as f:
            f.write(models)
    if prepare is not None:
        prepare(state)
    port = free_port()
    with open(os.environ.get("AOTX_BENCH_LOG", os.devnull), "ab") as log:
        proc = subprocess.Popen([python, "-m", "aotx", "--log-level", "WARNING", "serve",
                                 "--state-dir", state, "--port", str(port), *args],
                                stdout=subprocess.DEVNULL, stderr=log, cwd=cwd,
                                start_new_session=True, env={**os.environ, **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}", state_dir=state)
    try:
        wait_ready(server.url + "/readyz", proc)
    except BaseException:
        server.stop()
        raise
    token = open(os.path.join(state, "admin.token")).read().strip()
    server.headers = {"Authorization": f"Bearer {token}"}
    return server


def slots_file(slots: int | None, context: int = 2048) -> str | None:
    """A models file giving the embedded model ``slots`` of ``context`` tokens (None for
    None: aotx at its defaults), with ``$AOTX_BENCH_MODEL_EXTRA`` appended."""
    if slots is None:
        return None
    return (f"[default]\nslots = {slots}\ncontext = {context}\n"
            + os.environ.get("AOTX_BENCH_MODEL_EXTRA", ""))


@contextlib.contextmanager
def serving(models: str | None = None, **kw: Any) -> Iterator[Server]:
    """:func:`aotx` for the ``with`` block, stopped and removed at its end."""
    server = aotx(models, **kw)
    try:
        yield server
    finally:
        server.stop()


def launch(cmd: list[str], name: str, env: dict[str, str] | None = None,
           timeout: float = 300, interval: float = 0.2) -> Server:
    """``cmd`` with ``--port`` and a free port added (``env`` added to the environment),
    once its ``/health`` answers (asked every ``interval`` seconds)."""
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO,
                            env={**os.environ, **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}", name)
    try:
        wait_ready(server.url + "/health", proc, timeout, interval)
    except BaseException:
        server.stop()
        raise
    return server


def peer(spec: str, slots: int | None = None) -> Server:
    """llama-server (``spec``: its binary, or the URL of one running) on the embedded
    model on 2 threads (``-t 2``, as aotx's engine), with ``slots`` of 2048 tokens, or at
    its defaults for None."""
    if spec.startswith("http"):
        return Server(None, spec.rstrip("/"), "llama-server")
    from aotx.device.models import default_model_path

    shape = ["-t", "2"] + (["--parallel", str(slots), "-c", str(2048 * slots)]
                           if slots is not None else [])
    return launch([spec, "-m", default_model_path(), *shape, "--host", "127.0.0.1"],
                  "llama-server")


def thin(slots: int, context: int, env: dict[str, str] | None = None) -> Server:
    """``thin_server.py``: the same engine behind the thinnest server (the ceiling)."""
    return launch([sys.executable, "-m", "bench.thin_server", "--slots", str(slots),
                   "--context", str(context)], "thin", env)


def engine(**config: Any) -> LlamaEngine:
    """A ``LlamaEngine`` on the embedded model; ``config`` sets ``EngineConfig`` fields."""
    from aotx.device.models import default_model_path
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine

    return LlamaEngine(EngineConfig(path=default_model_path(), **config))


def model(**spec: Any) -> Loaded:
    """The embedded model as the device loads it (engine/llama/load.py: the engine, its
    scheduler, its embeddings); ``spec`` sets ``ModelSpec`` fields.  Its scheduler runs
    when the caller calls ``runner.run`` or steps it; ``loaded.close()`` frees it."""
    from aotx.device.models import default_model_path
    from aotx.engine.load import factory
    from aotx.engine.spec import ModelSpec

    fields = {"alias": "bench", "path": default_model_path(), "role": 1, **spec}
    return factory("llama")(ModelSpec(**fields), threading.Lock(), lambda: None,
                            lambda r: None)
