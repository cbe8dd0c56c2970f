"""What one principal's load costs another's plain calls, through the real service
(issue 39): the factor by which principal B's call latency grows while principal A
floods, for two floods.

    .venv/bin/python -m bench.bench_isolation [--rounds 3] [--seconds 20] [--only NAME]

* ``schemas``: A keeps 6 chat completions running, each under a JSON schema of an
  ``anyOf`` of 500 patterns (masks that cost more than the decode step); B sends plain
  8-token chat completions one after the other.
* ``embeddings``: A embeds 2,048 tokens a call from 10 threads; B embeds "hello world"
  one call after the other.

Each round measures B alone, then B beside A's flood (A B A B: this machine's speed
drifts, so only figures of one round compare).  It prints each round's B latency p50
and p95 alone and loaded, their ratios, and the medians of the rounds' ratios: the
factor docs/performance.md quotes.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import httpx

from bench import common

#: 500 patterns that overlap (letters, then digits, then a tag): inside the string every
#: one is still alive, and a mask costs ~3 ms (SmolLM2's 49k tokens), against a decode
#: step of ~12 ms for a few rows on two cores.
HEAVY = {"type": "object", "required": ["v"], "additionalProperties": False,
         "properties": {"v": {"anyOf": [
             {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 10}}}[0-9]{{{i % 5}}}x{i}$"}
             for i in range(500)]}}}
CHAT = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]}
FLOOD_EMBED = {"model": "smollm2", "input": [[100 + i for i in range(512)]] * 4}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown")


def heavy_chat(c: httpx.Client) -> int:
    return c.post("/v1/chat/completions", json={
        **CHAT, "max_tokens": 48, "messages": [{"role": "user", "content": "Pick a word."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "pick", "schema": HEAVY}}}).status_code


def plain_load(c: httpx.Client) -> int:
    """heavy_chat's request without its schema: the same slots and steps, no masks."""
    return c.post("/v1/chat/completions", json={
        **CHAT, "max_tokens": 48,
        "messages": [{"role": "user", "content": "Write a long story."}]}).status_code


def embed_flood(c: httpx.Client) -> int:
    return c.post("/v1/embeddings", json=FLOOD_EMBED).status_code


def plain_chat(c: httpx.Client) -> int:
    return c.post("/v1/chat/completions", json=CHAT).status_code


def hello_embed(c: httpx.Client) -> int:
    return c.post("/v1/embeddings", json={"model": "smollm2", "input": "hello world"}).status_code


#: name -> (B's call, A's threads, A's floods to compare, each beside B alone)
SCENARIOS: dict[str, tuple[Callable[[httpx.Client], int], int,
                           dict[str, Callable[[httpx.Client], int]]]] = {
    "schemas": (plain_chat, 6, {"plain": plain_load, "schema": heavy_chat}),
    "embeddings": (hello_embed, 10, {"embeddings": embed_flood}),
}


def measure(base: str, token: str, call: Callable[[httpx.Client], int],
            seconds: float) -> list[float]:
    """B's latencies (s) of ``call`` one after the other for ``seconds``; all must be 200."""
    out = []
    with httpx.Client(base_url=base, timeout=120,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        call(c)  # warm
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            t = time.monotonic()
            status = call(c)
            out.append(time.monotonic() - t)
            assert status == 200, status
    return out


def flood(base: str, token: str, call: Callable[[httpx.Client], int], threads: int,
          until: float, seen: dict[int, int]) -> list[threading.Thread]:
    def loop() -> None:
        with httpx.Client(base_url=base, timeout=120,
                          headers={"Authorization": f"Bearer {token}"}) as c:
            while time.monotonic() < until:
                status = call(c)
                seen[status] = seen.get(status, 0) + 1
                if status == 429:
                    time.sleep(0.5)
    out = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in out:
        t.start()
    return out


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(0.95 * len(xs)) - 1)]


def scenario(name: str, base: str, a: str, b: str, rounds: int, seconds: float) -> None:
    """Per round: B alone, then B beside each of A's floods (A B A B); the ratios of B's
    latency p50 and p95 to alone, and between the floods, as medians of the rounds'."""
    b_call, threads, floods = SCENARIOS[name]
    ratios: dict[str, list[tuple[float, float]]] = {k: [] for k in floods}
    for r in range(rounds):
        alone = measure(base, b, b_call, seconds)
        line = [f"alone p50 {1000 * statistics.median(alone):.1f} p95 {1000 * p95(alone):.1f}"]
        for label, a_call in floods.items():
            seen: dict[int, int] = {}
            until = time.monotonic() + seconds + 3
            started = flood(base, a, a_call, threads, until, seen)
            time.sleep(2)  # the flood under way
            loaded = measure(base, b, b_call, seconds)
            for t in started:
                t.join()
            ratios[label].append((statistics.median(loaded) / statistics.median(alone),
                                  p95(loaded) / p95(alone)))
            line.append(f"beside {label} p50 {1000 * statistics.median(loaded):.1f} p95 "
                        f"{1000 * p95(loaded):.1f} (A: {seen})")
        print(f"{name} round {r + 1}, B ms: " + "; ".join(line), flush=True)
    for label, rs in ratios.items():
        print(f"{name}: beside {label}, B's latency x alone: p50 "
              f"{statistics.median(x for x, _ in rs):.2f}, p95 "
              f"{statistics.median(y for _, y in rs):.2f}")
    if len(floods) == 2:
        (l1, r1), (l2, r2) = ratios.items()
        print(f"{name}: beside {l2} / beside {l1}: p50 "
              f"{statistics.median(x2 / x1 for (x1, _), (x2, _) in zip(r1, r2, strict=True)):.2f}, p95 "
              f"{statistics.median(y2 / y1 for (_, y1), (_, y2) in zip(r1, r2, strict=True)):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--only", choices=sorted(SCENARIOS))
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}")
    with common.serving(None) as srv:
        a, b = srv.mint("a-flood"), srv.mint("b-plain")
        for name in [args.only] if args.only else list(SCENARIOS):
            scenario(name, srv.url, a, b, args.rounds, args.seconds)


if __name__ == "__main__":
    main()
