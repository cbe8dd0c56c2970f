"""What a prompt chunk costs at depth, by its length: upstream llama.cpp's CPU flash
attention tiles only from 64 query rows per KV stream, aotx's build every chunk
(engine/chunking.py).

    .venv/bin/python -m bench.bench_chunking [--depths 450,1000] [--reps 2]
        [--lengths 16,24,33,48,63,64,65,96,128]

On the embedded model at aotx's defaults (16 streams of 4096 cells), for each depth it
fills sequence 0 with that many tokens, then evaluates chunks of each length after them
(cut back after each), and prints the median time of ``--reps`` and what the upstream
build's cost model decides for that chunk: widened (to 65 tokens) or not.  With another
build's ``llama_cpp`` package first on ``PYTHONPATH`` it measures that build.
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp

from aotx.engine.interface import BatchEntry
from aotx.engine.llama.chunking import ChunkCost, chunk_cost, fa_tile_min_rows
from bench import common

LENGTHS = (16, 24, 33, 48, 63, 64, 65, 96, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="450,1000")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = ap.parse_args()
    engine = common.engine()
    # the upstream cost model, whatever this build: aotx's own (tiles every chunk) widens nothing
    cost = ChunkCost.of(llama_cpp, engine.model)
    print(f"this build's flash attention tiles from {fa_tile_min_rows()} rows; aotx widens "
          f"{'as below' if chunk_cost(engine) else 'nothing (the column: an upstream build)'}",
          flush=True)
    words = " ".join(f"word{i}" for i in range(4000))
    tokens = engine.tokenize(words, False)
    for depth in (int(d) for d in args.depths.split(",")):
        engine.clear_sequence(0)
        for s in range(0, depth, 256):
            part = tokens[s:min(depth, s + 256)]
            assert engine.decode([BatchEntry(t, s + i, 0, False) for i, t in enumerate(part)]) == 0
        for n in (int(n) for n in args.lengths.split(",")):
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                assert engine.decode([BatchEntry(tokens[depth + i], depth + i, 0, i == n - 1)
                                      for i in range(n)]) == 0
                times.append(1e3 * (time.perf_counter() - t0))
                assert engine.trim_sequence(0, depth)
            back = cost.widen(n, depth, depth)
            print(f"depth {depth:5d}  chunk {n:3d}: {statistics.median(times):7.1f} ms  "
                  f"{f'widened to {n + back}' if back else 'as it is'}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
