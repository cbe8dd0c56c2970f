"""What CPU spent outside ggml on each token costs the decode, on this machine: the engine
alone decodes ``--streams`` sequences greedily (two threads, as aotx's device on 2 cores)
while a chain of helper processes, woken after each step as aotx's device, broker,
gateway and client are, burn a set CPU time for each token.

    .venv/bin/python -m bench.bench_intrusion [--costs 0,250,500,1000] [--hops 3]
        [--streams 1] [--steps 256] [--rounds 4] [--wait]

After each step the engine thread writes a byte to a pipe; ``--hops`` helper processes
in a chain each read it, burn their share of the step's cost (the cost in µs of CPU a
token times the step's tokens, split evenly: ``time.thread_time``, so that a helper
preempted is not counted as burning) and pass it on; the last passes it back.  By
default the engine goes on to the next decode at once, as aotx's engine thread does
while the tokens travel to their clients, and reads the bytes back once the
measurement ends (so that no burn runs into the next); with ``--wait`` it waits for
the chain's end after each step (the path run between decodes, on cores ggml left free).
The decode keeps two threads throughout (``threads = 2``; aotx's default follows the
free cores, docs/engine.md, and would keep two here: the chain stays under half a core).

Each round runs every cost once (A B A B); per cost it prints the CPU the helpers used
a token (schedstat: the burn, their wake-ups and their Python; the median of the
rounds), tok/s, the ratio against cost 0 (the median of the rounds' ratios, each
round's in brackets) and ``T / (T + used)``, the ratio that CPU would leave if each of
its µs cost the decode one µs (T: cost 0's time a token).  The ratio that a path of a
given cost allows is what an "of the engine alone" goal asks of it: aotx's path is
measured by ``bench_path``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from aotx.engine.interface import BatchEntry
from aotx.engine.llama.engine import LlamaEngine
from aotx.engine.llama.sampling import Sampler
from bench import common
from bench.bench_path import cpu

PIPE_ROOM = 4096  # bytes left in the chain's last pipe before ``ring`` reads them back

HELPER = r"""
import os, sys, time
share = float(sys.argv[1]) / 1e6
src, dst = int(sys.argv[2]), int(sys.argv[3])
while True:
    b = os.read(src, 1)
    if not b:
        break
    end = time.thread_time() + share
    while time.thread_time() < end:
        pass
    os.write(dst, b)
"""


class Chain:
    """``hops`` helper processes, each burning ``cost_us / hops`` of CPU a byte (``cost_us``:
    a step's); the last one passes the byte back, for ``ring`` to wait on with ``wait``
    and for ``drain`` to collect after a measurement without."""

    def __init__(self, cost_us: float, hops: int, wait: bool) -> None:
        pipes = [os.pipe() for _ in range(hops + 1)]
        self.head, self.tail = pipes[0][1], pipes[hops][0]
        self.wait = wait
        self.unread = 0  # bytes rung and not read back yet
        self.procs: list[subprocess.Popen[bytes]] = []
        for k in range(hops):
            src, dst = pipes[k][0], pipes[k + 1][1]
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", HELPER, str(cost_us / hops), str(src), str(dst)],
                pass_fds=(src, dst)))
        for r, w in pipes:  # the helpers hold their own ends now
            if r != self.tail:
                os.close(r)
            if w != self.head:
                os.close(w)

    def ring(self) -> None:
        os.write(self.head, b"t")
        self.unread += 1
        if self.wait or self.unread >= PIPE_ROOM:  # (a full pipe would stall the chain)
            self.drain()

    def drain(self) -> None:
        """Every byte rung, back: no burn of this measurement runs into the next."""
        while self.unread:
            self.unread -= len(os.read(self.tail, self.unread))

    def cpu(self) -> float:
        """The helpers' CPU time so far, in seconds (their one thread's schedstat)."""
        return sum(cpu(f"/proc/{p.pid}/schedstat") or 0.0 for p in self.procs)

    def close(self) -> None:
        os.close(self.head)  # each helper reads the end of its pipe and exits
        for p in self.procs:
            p.wait(30)
        os.close(self.tail)


def decode(e: LlamaEngine, prompt: list[int], streams: int, steps: int,
           chain: Chain | None) -> tuple[float, float]:
    """(tok/s, the chain's CPU µs a token) of ``steps`` greedy decode steps of ``streams``
    sequences, the chain rung after each."""
    n = len(prompt)
    samplers = [Sampler(0.0, 1.0, 0) for _ in range(streams)]
    cur = []
    for q in range(streams):
        e.clear_sequence(q)
        assert e.decode([BatchEntry(t, i, q, i == n - 1) for i, t in enumerate(prompt)]) == 0
        cur.append(e.sample(samplers[q], n - 1))
    burnt = chain.cpu() if chain else 0.0
    t0 = time.perf_counter()
    for k in range(steps):
        assert e.decode([BatchEntry(cur[q], n + k, q, True) for q in range(streams)]) == 0
        cur = [e.sample(samplers[q], q) for q in range(streams)]
        if chain is not None:
            chain.ring()
    wall = time.perf_counter() - t0
    if chain is not None:
        chain.drain()
        burnt = chain.cpu() - burnt
    return streams * steps / wall, 1e6 * burnt / (streams * steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--costs", default="0,250,500,1000", help="µs of CPU a token, in all")
    ap.add_argument("--hops", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--wait", action="store_true", help="the engine waits for the chain")
    args = ap.parse_args()
    costs = [float(c) for c in args.costs.split(",")]
    if 0.0 not in costs:
        costs.insert(0, 0.0)
    e = common.engine(slots=args.streams, slot_context=1024, batch=512, threads=2)
    prompt = e.tokenize("<|im_start|>user\nWrite a short story about the sea.<|im_end|>\n"
                        "<|im_start|>assistant\n", False)
    decode(e, prompt, args.streams, 32, None)  # warm
    chains: dict[float, Chain] = {}
    speeds: dict[float, list[float]] = {c: [] for c in costs}
    burnt: dict[float, list[float]] = {c: [] for c in costs}
    try:
        for c in costs:
            if c:
                chains[c] = Chain(c * args.streams, args.hops, args.wait)
        for _ in range(args.rounds):
            for c in costs:
                tok_s, us = decode(e, prompt, args.streams, args.steps, chains.get(c))
                speeds[c].append(tok_s)
                burnt[c].append(us)
    finally:
        for chain in chains.values():
            chain.close()
    print(f"{args.streams} stream(s), {args.steps} steps, {args.hops} hops, "
          f"{'waited for' if args.wait else 'not waited for'}; {args.rounds} rounds")
    t = 1e6 / statistics.median(speeds[0.0])  # µs a token at cost 0
    for c in costs:
        rs = [a / b for a, b in zip(speeds[c], speeds[0.0], strict=True)]
        shown = "/".join(f"{r:.2f}" for r in rs)
        used = statistics.median(burnt[c])
        print(f"  cost {c:6.0f} µs (the helpers used {used:6.0f})  "
              f"{statistics.median(speeds[c]):6.1f} tok/s  ratio {statistics.median(rs):.3f} "
              f"[{shown}]  T/(T+used) {t / (t + used):.3f}")


if __name__ == "__main__":
    main()
