"""What logprobs cost per token, on the engine thread: the step's rows copied out of
llama.cpp's logits buffer, the log-softmax over the vocabulary and the top-k
(``argpartition``), and the token's annotation line (engine/logprobs.py).

    .venv/bin/python -m bench.bench_logprobs [--vocab 49152] [--repeat 200]

No model: random float32 logits of SmolLM2's vocabulary (49152), ``n`` rows a step (the
sequences that asked), ``k`` alternatives each.  It prints the median microseconds per
step and per token of each part.  A request that does not ask logprobs pays none of it
(``annotate`` returns before touching a row).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from aotx.engine.logprobs import compute, line


def median_us(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    buffer = rng.normal(0, 4, (16, args.vocab)).astype(np.float32)  # llama.cpp's rows
    pieces = {t: f"tok{t}".encode() for t in range(args.vocab)}
    print(f"vocabulary {args.vocab}; median of {args.repeat}; microseconds")
    print(f"{'n':>3} {'k':>3} {'copy/step':>10} {'compute/step':>13} {'line/token':>11} "
          f"{'total/token':>12}")
    for n in (1, 8):
        for k in (0, 5, 20):
            out = np.empty((n, args.vocab), dtype=np.float32)

            def copy(n: int = n, out: np.ndarray = out) -> None:
                for i in range(n):
                    out[i] = buffer[i]

            tokens, ks = list(range(n)), [k] * n
            entries = compute(out, tokens, ks)
            c = median_us(copy, args.repeat)
            s = median_us(lambda out=out, tokens=tokens, ks=ks: compute(out, tokens, ks),
                          args.repeat)
            j = median_us(lambda e=entries[0]: line(0, e, pieces.__getitem__, b"tok0"),
                          args.repeat)
            print(f"{n:>3} {k:>3} {c:>10.1f} {s:>13.1f} {j:>11.1f} {(c + s) / n + j:>12.1f}")


if __name__ == "__main__":
    main()
