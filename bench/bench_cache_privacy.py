"""Does another principal's copy of a cached prompt cost a fresh prompt's time?

    .venv/bin/python -m bench.bench_cache_privacy [--rounds 3] [--items 150]

Starts ``aotx serve`` (from this checkout) on a free port, mints principals A and B, and
per round times a long prompt (about 1400 tokens) sent by A (fresh), the same text by B,
and by A again.  With the prompt cache private to its principal, B pays what A paid
fresh and A's second send is cached; a cache shared across principals would answer B
as fast as A's second (the timing attack of CVE-2025-46570).
"""

from __future__ import annotations

import argparse
import time

import httpx

from bench.common import Server, serving
from tests.helpers import SMALL_MODELS


def timed(svc: Server, token: str, body: dict[str, object]) -> tuple[float, int]:
    t = time.monotonic()
    r = httpx.post(svc.url + "/v1/chat/completions", json=body, timeout=300,
                   headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    return time.monotonic() - t, int(r.json()["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--items", type=int, default=150)
    args = ap.parse_args()
    with serving(SMALL_MODELS) as svc:
        a, b = svc.mint("a"), svc.mint("b")
        for rnd in range(args.rounds):
            text = " ".join(f"item {i} is {(i * 7919 + rnd) % 1000}" for i in range(args.items))
            body: dict[str, object] = {"model": "smollm2", "max_tokens": 1, "temperature": 0,
                                       "messages": [{"role": "user", "content": text}]}
            (fa, n), (fb, _), (fa2, _) = (timed(svc, t, body) for t in (a, b, a))
            print(f"round {rnd}: prompt {n} tokens; A fresh {fa:.2f} s, B same text "
                  f"{fb:.2f} s, A again {fa2:.2f} s; B / A fresh {fb / fa:.2f}", flush=True)


if __name__ == "__main__":
    main()
