"""aotx from two source trees, A B A B: did a change make serving faster?

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m bench.bench_trees /tmp/before [--after .] [--clients 4,8]
        [--rounds 3] [--requests 2] [--max-tokens 128]

Each round starts a default service (no models file) from the ``before`` tree, runs
``bench_serve``'s streaming load at each N (temperature 0, distinct prompts, a fresh
connection per request), stops it, then does the same from the ``after`` tree (the
working tree by default).  Both use this interpreter and its packages; only the
``aotx`` package differs (``PYTHONPATH``; a tree that also holds a ``llama_cpp`` package,
for example a link to another build's, runs on that one).  Per N it prints each round's tok/s and
inter-token p50, and the median of the rounds' after / before ratios: this VM's speed
drifts, so only ratios of figures measured minutes apart count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from bench import common
from bench.bench_serve import run_load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", help="the source tree to compare against (a git worktree)")
    ap.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), help="the source tree under test (default: this one)")
    ap.add_argument("--clients", default="4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    for tree in trees.values():
        if not os.path.isfile(os.path.join(tree, "aotx", "__init__.py")):
            raise SystemExit(f"{tree}: no aotx package there")
    clients = [int(x) for x in args.clients.split(",")]
    got: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for name, tree in trees.items():
            # PYTHONSAFEPATH: ``python -m aotx`` would otherwise import the package from
            # the current directory, before PYTHONPATH (both trees would be this one).
            env = {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}
            with common.serving("", env=env) as svc:
                asyncio.run(run_load(svc.url, svc.headers, "smollm2", 1, 1, 16, 900))  # warm
                for n in clients:
                    out = asyncio.run(run_load(svc.url, svc.headers, "smollm2", n,
                                               args.requests, args.max_tokens,
                                               100 * n + 1000 * r))
                    itl = statistics.median(out["itl"]) * 1e3
                    got.setdefault((n, name), []).append((out["tok_s"], itl))
                    print(f"round {r + 1} {name:6s} N={n:2d} {out['tok_s']:6.1f} tok/s "
                          f"ITL p50 {itl:6.2f} ms", flush=True)
    for n in clients:
        before, after = got[(n, "before")], got[(n, "after")]
        each = [a[0] / b[0] for a, b in zip(after, before, strict=True)]
        print(f"N={n:2d}: after/before tok/s {statistics.median(each):.3f} "
              f"[{'/'.join(f'{x:.3f}' for x in each)}]; ITL p50 before "
              f"{statistics.median(x[1] for x in before):.2f} ms, after "
              f"{statistics.median(x[1] for x in after):.2f} ms")


if __name__ == "__main__":
    main()
