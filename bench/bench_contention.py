"""What another busy process costs: aotx's answers and the engine's decode steps, alone and
beside a process that keeps one core busy, by ggml thread count.

    .venv/bin/python -m bench.bench_contention [--threads 0,1] [--tokens 32] [--rounds 2]

For each ``threads`` (the models file's; 0 is the default, one a core) it starts aotx and,
A B A B, times a greedy chat completion of ``--tokens`` tokens (the median of three) with
nothing else running and beside ``python -c 'while 1: pass'``; then it times one
stream's decode steps on the engine alone (depth ~100, the median of 30), the same way.
On 2 cores (AMD EPYC, 2026-12-06, issue 40), two fixed ggml threads beside the busy
process made a 32-token answer 47 x slower (0.39 -> 18.3 s; in a second run 0.44 -> 78.6 s)
while the engine alone was 1.6-2 x slower (12.0 -> 22.4 ms a step): ggml's compute
threads spin in the graph's barriers whenever one of them is descheduled, and the
service's own threads then wait for a CPU too.  Since ``threads = 0`` follows the free
cores (engine/llama/cores.py): 0.30 -> 0.53 s; one thread: 0.51 -> 0.49 s.  The
engine-alone figure is 30 steps, shorter than the window the count is decided on.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from aotx.engine.interface import BatchEntry
from bench import common


@contextmanager
def busy(on: bool) -> Iterator[None]:
    """A process that keeps one core busy, for the ``with`` block (when ``on``)."""
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if on else None
    try:
        time.sleep(0.5)
        yield
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def answer(srv: common.Server, tokens: int) -> float:
    """Seconds for a greedy chat completion of ``tokens`` tokens (the median of three)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": tokens, "temperature": 0}
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        httpx.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers,
                   timeout=900).raise_for_status()
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def decode_ms(threads: int, steps: int = 30) -> float:
    """One stream's decode step at depth ~100, engine alone: ms (the median)."""
    e = common.engine(slots=1, slot_context=512, batch=128, threads=threads)
    try:
        toks = e.tokenize("word " * 100, False)
        assert e.decode([BatchEntry(t, i, 0, False) for i, t in enumerate(toks)]) == 0
        took = []
        for s in range(steps):
            t0 = time.perf_counter()
            assert e.decode([BatchEntry(toks[s], len(toks) + s, 0, True)]) == 0
            took.append(time.perf_counter() - t0)
        return statistics.median(took) * 1e3
    finally:
        e.close()


def rounds(n: int, measure: Callable[[], float]) -> tuple[list[float], list[float]]:
    """(alone, beside the busy process) figures, A B A B."""
    alone: list[float] = []
    loaded: list[float] = []
    for _ in range(n):
        for on, out in ((False, alone), (True, loaded)):
            with busy(on):
                out.append(measure())
    return alone, loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="0,1")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for threads in (int(x) for x in args.threads.split(",")):
        with common.serving(f"[default]\nthreads = {threads}\n") as srv:
            answer(srv, 4)  # warm
            a, b = rounds(args.rounds, functools.partial(answer, srv, args.tokens))
        e, f = rounds(args.rounds, functools.partial(decode_ms, threads))
        print(f"threads={threads}: a {args.tokens}-token answer {statistics.median(a):.2f} s "
              f"alone, {statistics.median(b):.2f} s beside a busy core "
              f"({statistics.median(b) / statistics.median(a):.1f} x); a decode step "
              f"{statistics.median(e):.1f} ms alone, {statistics.median(f):.1f} ms beside it",
              flush=True)


if __name__ == "__main__":
    main()
