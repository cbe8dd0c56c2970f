"""aotx configurations against each other and llama-server, streaming chat, A B A B.

    .venv/bin/python -m bench.bench_variants 'default=;poll0=models:FILE;peer=BIN' \\
        [--clients 1] [--rounds 4] [--requests 3]

Each variant is ``NAME=SETTINGS``: ``peer=BIN`` is llama-server (``BIN``, on ``-t 2`` at
its defaults); any other name is ``aotx serve`` with comma-separated settings:
``models:FILE`` (a models file, e.g. ``[default]`` with ``poll = 0``), ``lib:DIR`` (a
folder whose ``llama_cpp`` goes first on ``PYTHONPATH``: another build of llama.cpp's
libraries), ``tree:DIR`` (another checkout of aotx, e.g. ``git worktree add DIR REV``:
its code against this one's) or ``VAR:VALUE`` (an environment variable).  Each round starts each variant
in turn, streams ``--requests`` chat completions per client (as ``bench_serve``: 128
tokens, temperature 0) and stops it.  It prints per variant and client count the median
tok/s and inter-token p50, and the median of the rounds' ratios to the last variant.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench import common
from bench.bench_serve import pct, run_load


def start(name: str, settings: str) -> common.Server:
    if name == "peer":
        return common.peer(settings)
    env: dict[str, str] = {}
    models = tree = None
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition(":")
        if key == "models":
            with open(value) as f:
                models = f.read()
        elif key == "lib":
            env["PYTHONPATH"] = value
        elif key == "tree":
            tree = value
        else:
            env[key] = value
    return common.aotx(models, env=env, cwd=tree)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", help="NAME=SETTINGS;NAME=SETTINGS;... (the last is the base)")
    ap.add_argument("--clients", default="1")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="requests per client per round")
    args = ap.parse_args()
    variants = [tuple(v.split("=", 1)) for v in args.variants.split(";")]
    clients = [int(x) for x in args.clients.split(",")]
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for name, settings in variants:
            server = start(name, settings)
            try:
                model = "x" if name == "peer" else "smollm2"
                for n in clients:
                    out = asyncio.run(run_load(server.url, server.headers or {}, model, n,
                                               args.requests, 128, 100 * r))
                    itl = 1e3 * pct(out["itl"], 50)
                    results.setdefault((name, n), []).append((out["tok_s"], itl))
                    print(f"round {r} {name:12s} N={n:2d} {out['tok_s']:6.1f} tok/s "
                          f"ITL p50 {itl:5.2f} ms", flush=True)
            finally:
                server.stop()
    base = variants[-1][0]
    for n in clients:
        for name, _ in variants:
            got, ref = results[(name, n)], results[(base, n)]
            ratios = [a[0] / b[0] for a, b in zip(got, ref, strict=True)]
            print(f"N={n:2d} {name:12s} {statistics.median(x[0] for x in got):6.1f} tok/s  "
                  f"ITL p50 {statistics.median(x[1] for x in got):5.2f} ms  / {base} "
                  f"{statistics.median(ratios):.3f} {[round(x, 2) for x in ratios]}")


if __name__ == "__main__":
    main()
