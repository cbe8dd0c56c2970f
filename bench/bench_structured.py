"""Structured outputs through the service: 8 streams each under a ``json_schema`` against
8 free ones, A B A B, and beside them llama.cpp's server doing the same when given.

    .venv/bin/python -m bench.bench_structured [--streams 8] [--tokens 96] [--rounds 3]
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python -m bench.bench_structured

Each round runs, one after the other: aotx constrained, aotx free, then (with a peer)
the peer constrained and the peer free.  Every request is a streaming chat completion
at temperature 0 with a distinct prompt, ``max_tokens`` = ``--tokens``; the schema asks
for a long array of small objects (``minItems`` past what fits), so a constrained
stream always runs to ``max_tokens``, and the free prompt asks for a long list, so
both sides decode about the same number of tokens in a batch of the same size.
Throughput is completion tokens over the wall time of the round's batch of streams.

It prints per round each side's tok/s, then the medians and the ratios (each the median
of the rounds' own ratios: this VM's speed drifts) constrained / free per server and
aotx / peer per mode, and aotx's mask cost from ``/metrics``: the mask worker's time
per constrained step and per mask (beside the decode), and what the engine thread still
waited for after the decode (the cost on the critical path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import httpx

from bench import common

ITEM = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": ITEM,
                                                      "minItems": 200}},
          "required": ["people"], "additionalProperties": False}
TOPICS = ["a ship's crew", "a football team", "a school class", "an orchestra", "a village",
          "a hospital ward", "a film cast", "a chess club", "a space station", "a bakery"]


def body(i: int, tokens: int, constrained: bool, model: str) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    if constrained:
        ask = f"List the people of {topic} (#{i}) as JSON: name, age and role of each."
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "people", "schema": SCHEMA, "strict": True}}}
    else:
        ask = f"List the people of {topic} (#{i}), one per line, with a long description of each."
        extra = {}
    return {"model": model, "messages": [{"role": "user", "content": ask}], "temperature": 0,
            "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            **extra}


async def one(c: httpx.AsyncClient, headers: dict[str, str], req: dict[str, Any]) -> int:
    tokens = 0
    async with c.stream("POST", "/v1/chat/completions", json=req, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def side(base: str, headers: dict[str, str], model: str, streams: int, tokens: int,
               constrained: bool, offset: int) -> float:
    """Completion tok/s of ``streams`` concurrent streams."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(c, headers, body(offset + k, tokens, constrained,
                                                             model))
                                        for k in range(streams)))
        return sum(counts) / (time.perf_counter() - t0)


def grammar_metrics(base: str, headers: dict[str, str]) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("aotx_grammar_") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def ratio(xs: list[float], ys: list[float]) -> str:
    rs = [x / y for x, y in zip(xs, ys, strict=True)]
    return f"{statistics.median(rs):.3f} (rounds {', '.join(f'{r:.2f}' for r in rs)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    peer_spec = os.environ.get("LLAMA_SERVER")
    aotx = common.aotx(common.slots_file(args.streams))
    base, headers = aotx.url, aotx.headers
    peer: common.Server | None = None
    pbase, pmodel = "", ""
    sides: dict[str, list[float]] = {"aotx json_schema": [], "aotx free": [],
                                     "peer json_schema": [], "peer free": []}
    try:
        if peer_spec:
            peer = common.peer(peer_spec, args.streams)
            pbase, pmodel = peer.url, "default"
        # warm-up: the compiler's tokenizer (first constrained request) and both servers
        asyncio.run(side(base, headers, "smollm2", 2, 8, True, 10_000))
        if peer:
            asyncio.run(side(pbase, {}, pmodel, 2, 8, True, 10_000))
        m0 = grammar_metrics(base, headers)
        for r in range(args.rounds):
            at = 100 * r
            for name, url, hdr, model, constrained in (
                    ("aotx json_schema", base, headers, "smollm2", True),
                    ("aotx free", base, headers, "smollm2", False),
                    ("peer json_schema", pbase, {}, pmodel, True),
                    ("peer free", pbase, {}, pmodel, False)):
                if url:
                    sides[name].append(asyncio.run(side(url, hdr, model, args.streams,
                                                        args.tokens, constrained, at)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s"
                                                  for k, v in sides.items() if v), flush=True)
        m1 = grammar_metrics(base, headers)
    finally:
        aotx.stop()
        if peer is not None:
            peer.stop()
    print("\nmedians: " + ", ".join(f"{k} {statistics.median(v):.1f} tok/s"
                                    for k, v in sides.items() if v))
    print("aotx json_schema / free: " + ratio(sides["aotx json_schema"], sides["aotx free"]))
    if peer:
        print("peer json_schema / free: " + ratio(sides["peer json_schema"], sides["peer free"]))
        print("aotx / peer, json_schema: " + ratio(sides["aotx json_schema"],
                                                   sides["peer json_schema"]))
        print("aotx / peer, free: " + ratio(sides["aotx free"], sides["peer free"]))
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    steps, masks = d["aotx_grammar_steps_total"], d["aotx_grammar_masks_total"]
    fill, wait = d["aotx_grammar_fill_seconds_total"], d["aotx_grammar_wait_seconds_total"]
    print(f"aotx masks: {steps:.0f} constrained steps, {masks:.0f} masks; fill "
          f"{fill / steps * 1e3:.3f} ms/step ({fill / masks * 1e6:.0f} us/mask) beside the "
          f"decode; waited {wait / steps * 1e3:.3f} ms/step after it")


if __name__ == "__main__":
    main()
