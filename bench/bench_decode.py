"""A decode step at depth, the engine alone: S sequences, each D tokens deep, decode one
token each in one ``llama_decode`` (a KV stream per sequence, aotx's defaults).

    .venv/bin/python -m bench.bench_decode \\
        [--cases 1x100,1x1000,8x150,8x1000] [--rounds 2] [--steps 8] \\
        [--build upstream=/path/holding/another/llama_cpp]

Each configuration runs in a process of its own, in turn (A B A B ...): the installed
build with flash attention, the same without it (the reference a decode step with flash
attention is held to), and every ``--build NAME=DIR`` (a folder whose ``llama_cpp``
package goes first on ``PYTHONPATH``) with flash attention.  It prints each case's
median over the rounds (each round's own median of ``--steps`` steps) and its ratio to
the first configuration's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(cases: list[tuple[int, int]], steps: int, flash: bool) -> dict[str, float]:
    """Median ms of a decode step for each (sequences, depth), in this process (its
    PYTHONPATH holds the checkout: main sets it)."""
    from aotx.engine.interface import BatchEntry
    from bench import common

    engine = common.engine(flash_attention=flash)
    tokens = engine.tokenize(" ".join(f"word{i}" for i in range(4000)), False)
    out = {}
    for n_seq, depth in cases:
        for s in range(n_seq):  # each sequence its own text, filled in 256-token chunks
            for a in range(0, depth, 256):
                part = tokens[a + s:min(depth, a + 256) + s]
                assert engine.decode([BatchEntry(t, a + i, s, False)
                                      for i, t in enumerate(part)]) == 0
        times = []
        for r in range(steps):
            t0 = time.perf_counter()
            assert engine.decode([BatchEntry(tokens[depth + r], depth + r, s, True)
                                  for s in range(n_seq)]) == 0
            times.append(1e3 * (time.perf_counter() - t0))
        for s in range(n_seq):
            engine.clear_sequence(s)
        out[f"{n_seq}x{depth}"] = statistics.median(times)
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x100,1x1000,8x150,8x1000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # "fa" or "nofa": measure here
    args = ap.parse_args()
    cases = [(int(c.split("x")[0]), int(c.split("x")[1])) for c in args.cases.split(",")]
    if args.child:
        print(json.dumps(measure(cases, args.steps, args.child == "fa")))
        return
    configs = [("this build", None, "fa"), ("this build, no flash attention", None, "nofa")]
    configs += [(name, path, "fa") for name, path in
                (b.split("=", 1) for b in args.build)]
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in configs}
    for _ in range(args.rounds):
        for label, path, mode in configs:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (path, ROOT) if p)
            run = subprocess.run([sys.executable, __file__, "--cases", args.cases,
                                  "--steps", str(args.steps), "--child", mode],
                                 env=env, capture_output=True, text=True, check=True)
            results[label].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"  {label}: {results[label][-1]}", flush=True)
    first = configs[0][0]
    print(f"\nms a decode step, median of {args.rounds} rounds (ratio to {first}):")
    for label, _, _ in configs:
        cells = []
        for key in (f"{s}x{d}" for s, d in cases):
            ms = statistics.median(r[key] for r in results[label])
            base = statistics.median(r[key] for r in results[first])
            cells.append(f"{key}: {ms:6.1f} ({ms / base:4.2f})")
        print(f"{label:32s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
