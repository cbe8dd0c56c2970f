"""Models loaded on first use: the time from a request for an unloaded model to its first
token, aotx against llama-server's router mode (``--models-dir DIR --models-max 1``,
without ``-m``), A B A B.

    .venv/bin/python -m bench.bench_on_demand [--peer BUILD/bin/llama-server] [--rounds 3]

The models folder holds two copies of the embedded SmolLM2 (``a.gguf``, ``b.gguf``).  Each
round starts each server afresh and times, streamed and greedy: the first request for
``a`` (a load), then the first for ``b``: a switch, since neither server holds both
(llama-server's ``--models-max 1``; aotx's memory budget, room for the embedded model and
one of the two, so ``b``'s load unloads ``a``).  aotx loads in its running device;
llama-server's router starts a process per model.  Without ``--peer``, aotx alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import httpx

from aotx.device.catalog import folder_specs
from aotx.device.models import default_model_path, load_specs
from aotx.engine.load import describe
from bench import common


def first_token(srv: common.Server, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content byte."""
    body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                      headers=srv.headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            compact = line.replace(" ", "")
            if '"content":"' in compact and '"content":""' not in compact:
                return time.perf_counter() - t0
    raise SystemExit(f"{srv.name}: no content from {model}")


def folder(state: str) -> str:
    models = os.path.join(state, "models")
    os.makedirs(models, exist_ok=True)
    for name in ("a.gguf", "b.gguf"):
        try:  # a file of its own, hard-linked where the filesystem allows
            os.link(default_model_path(), os.path.join(models, name))
        except OSError:
            shutil.copyfile(default_model_path(), os.path.join(models, name))
    return models


def budget() -> int:
    """Room for the embedded model (loaded at start) and one of ``a`` and ``b``, not both,
    as llama-server's ``--models-max 1``: the first request for ``b`` unloads ``a``."""
    with tempfile.TemporaryDirectory() as state:
        fixed = describe(load_specs(state)[0]).memory_bytes
    with tempfile.TemporaryDirectory() as state:  # a models-folder model's settings
        one = describe(folder_specs(folder(state), [])[0]).memory_bytes
    return fixed + one + one // 2


def aotx_round() -> tuple[float, float]:
    with common.serving(prepare=folder, args=["--memory-budget", str(budget())]) as srv:
        times = first_token(srv, "a"), first_token(srv, "b")
        metrics = httpx.get(srv.url + "/metrics", headers=srv.headers).text
        if 'aotx_model_evictions_total{model="a"} 1.0' not in metrics:
            raise SystemExit("aotx: b's load did not unload a (no switch was timed)")
        return times


def peer_round(binary: str) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        state = tempfile.mkdtemp(prefix="peer-", dir="/tmp")
        srv = common.launch([binary, "--models-dir", folder(state), "--models-max", "1",
                             "-t", "2", "--host", "127.0.0.1"], "llama-server")
        try:
            return first_token(srv, "a"), first_token(srv, "b")
        finally:
            srv.stop()
            shutil.rmtree(state, ignore_errors=True)
    return run


def peer_alone(binary: str) -> tuple[float, float]:
    """llama-server with the model named (``-m``), for what its router's child costs:
    seconds from its start to ``/health`` answering 200, then to a first token."""
    t0 = time.perf_counter()
    srv = common.launch([binary, "-m", default_model_path(), "-t", "2", "--host",
                         "127.0.0.1"], "llama-server -m", interval=0.005)
    try:
        ready = time.perf_counter() - t0
        return ready, first_token(srv, "smollm2")
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", help="llama-server binary (router mode)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, Callable[[], tuple[float, float]]] = {"aotx": aotx_round}
    if args.peer:
        runs["llama-server"] = peer_round(args.peer)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():  # A B A B
            got[name].append(run())
    for name, pairs in got.items():
        first = statistics.median(p[0] for p in pairs)
        second = statistics.median(p[1] for p in pairs)
        print(f"{name}: first token of an unloaded model {first:.2f} s; of a second "
              f"model {second:.2f} s (medians of {len(pairs)})", flush=True)
    if args.peer:
        alone = [peer_alone(args.peer) for _ in range(args.rounds)]
        print(f"llama-server -m: start to ready {statistics.median(a for a, _ in alone):.2f} s,"
              f" then first token {statistics.median(b for _, b in alone):.2f} s", flush=True)
        for i, what in enumerate(("unloaded model", "second model")):
            ratio = (statistics.median(p[i] for p in got["aotx"])
                     / statistics.median(p[i] for p in got["llama-server"]))
            print(f"aotx / llama-server, {what}: {ratio:.2f}")


if __name__ == "__main__":
    main()
