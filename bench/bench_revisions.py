"""The fast paths of two revisions side by side: admission latency and window reads.

    .venv/bin/python -m bench.bench_revisions OLD NEW [--rounds 4] [--seconds 5]

OLD and NEW are git revisions of this repository.  Each is checked out into a
temporary worktree (removed at the end) and served in turn, A B A B, by a fresh
``aotx serve`` started from that worktree with this virtual environment's Python
(``python -m aotx`` imports the package from the working directory, so the
dependencies are this checkout's and must not differ between the two).  Each run
measures what ``bench_serve`` measures for these paths: 60 admissions one after
another while 8 streams decode (p50), then window reads on 2 keep-alive
connections for ``--seconds``.  It prints each round, the medians and the ratios
NEW/OLD per round: only ratios from one run count on a machine whose speed drifts.
OLD and NEW may name the same revision: the ratios then show the machine's noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench import bench_serve as bench
from bench import common

REPO = Path(__file__).resolve().parent.parent


def worktree(rev: str, parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", path, rev],
                   check=True, capture_output=True)
    return path


def measure(tree: str, seconds: float) -> tuple[float, float]:
    """One fresh server from ``tree``: (admission p50 in ms, window reads per second)."""
    with common.serving(common.slots_file(16), cwd=tree) as srv:
        latencies = asyncio.run(bench.admission_latency(srv.url, srv.headers))
        rate = asyncio.run(bench.window_reads(srv.url, srv.headers, seconds))
    return bench.pct(latencies, 50) * 1e3, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    names = {"OLD": args.old, "NEW": args.new}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="aotx-revs-") as parent:
        trees = {name: worktree(rev, parent, name) for name, rev in names.items()}
        try:
            for rnd in range(1, args.rounds + 1):
                for name, tree in trees.items():
                    p50, rate = measure(tree, args.seconds)
                    results[name].append((p50, rate))
                    print(f"round {rnd} {name} {names[name]}: admission p50 {p50:.2f} ms, "
                          f"window reads {rate:.0f} req/s", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", tree],
                               check=False, capture_output=True)
    for name, rows in results.items():
        print(f"{name} {names[name]}: admission p50 median "
              f"{statistics.median(r[0] for r in rows):.2f} ms, "
              f"window reads median {statistics.median(r[1] for r in rows):.0f} req/s")
    pairs = list(zip(results["NEW"], results["OLD"], strict=True))
    print("NEW/OLD per round: admission", [round(n[0] / o[0], 2) for n, o in pairs],
          "window reads", [round(n[1] / o[1], 2) for n, o in pairs])


if __name__ == "__main__":
    main()
