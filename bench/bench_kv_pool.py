"""The KV layout on the embedded model, engine only: one stream per sequence (the former
layout) against the shared pool, f16 and q8_0; and q8_0's greedy outputs against f16's.

    .venv/bin/python -m bench.bench_kv_pool [--rounds 2] [--quality]

Speed: N sequences each evaluate a prompt of L tokens, then 48 decode steps of one token
each are timed; tokens per second, per round (layouts alternate within a round).
``--quality``: 20 short chat prompts answered greedily (128 tokens) with an f16 pool
and a q8_0 pool; how many answers are equal, and at which token the others first differ.
"""

from __future__ import annotations

import argparse
import threading
import time

from aotx.device.template import ChatTemplate
from aotx.engine.interface import BatchEntry
from aotx.engine.llama.sampling import Sampler
from aotx.engine.llama.scheduler import Request, Scheduler
from aotx.wire import Phase
from bench import common

LAYOUTS = (("streams", False, "f16"), ("pool", True, "f16"), ("pool", True, "q8_0"))
SHAPES = ((1, 200), (8, 300), (16, 300), (16, 1000))
PROMPTS = ["Tell me a short story about a cat.", "Describe the sea in a few sentences.",
           "Write a short poem about the moon.", "Explain how rain forms.",
           "Tell me about the history of bread.", "What is the capital of France?",
           "List three fruits.", "How do airplanes fly?", "Give me a recipe for pancakes.",
           "What is photosynthesis?", "Count from one to ten.", "Say hello in French.",
           "Why is the sky blue?", "What is 12 times 12?", "Name five animals.",
           "Write a haiku about winter.", "What does a computer do?",
           "Explain gravity to a child.", "What is the largest ocean?", "Describe a forest."]


def decode_speed(unified: bool, kv_type: str, n: int, length: int, steps: int = 48) -> float:
    e = common.engine(slots=n, slot_context=4096,
                      kv_cells=max(8192, n * (length + 64)), kv_type=kv_type,
                      unified=unified, batch=512, threads=2)
    try:
        for s in range(n):
            toks = [(7 * s + 13 * i) % 5000 + 100 for i in range(length)]
            for a in range(0, length, 512):
                part = toks[a:a + 512]
                assert e.decode([BatchEntry(t, a + i, s, False) for i, t in enumerate(part)]) == 0
        t0 = time.perf_counter()
        for k in range(steps):
            assert e.decode([BatchEntry(100 + k, length + k, s, True) for s in range(n)]) == 0
        return n * steps / (time.perf_counter() - t0)
    finally:
        e.close()


def greedy_answers(kv_type: str) -> list[list[int]]:
    e = common.engine(slots=1, slot_context=1024,
                      kv_cells=1024, kv_type=kv_type, batch=256, threads=2)
    try:
        tmpl = ChatTemplate(e.metadata("tokenizer.chat_template"))
        sched = Scheduler(e, 1, 256, threading.Lock(),
                          make_sampler=lambda r: Sampler(0.0, 1.0, 1),
                          free_sampler=lambda s: s.free())  # type: ignore[attr-defined]
        out = []
        for i, q in enumerate(PROMPTS):
            e.clear_sequence(0)
            sched.cached.clear()  # each prompt from an empty cache
            prompt = e.tokenize(tmpl.render([{"role": "user", "content": q}]), False)
            r = Request(identity=bytes([i]) * 16, principal=1, revision=1, role=1,
                        prompt=prompt, max_tokens=128)
            with sched.lock:
                sched.submit(r)
            while sched.step():
                pass
            assert r.phase is Phase.COMPLETED
            out.append(list(r.generated))
        return out
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quality", action="store_true")
    args = ap.parse_args()
    if args.quality:
        a, b = greedy_answers("f16"), greedy_answers("q8_0")
        firsts = sorted(next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                             min(len(x), len(y))) for x, y in zip(a, b, strict=True) if x != y)
        print(f"q8_0 vs f16 greedy: {sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} "
              f"equal; the others first differ at tokens {firsts}")
        return
    for n, length in SHAPES:
        figures: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, unified, kv_type in LAYOUTS:
                figures.setdefault(f"{name} {kv_type}", []).append(
                    decode_speed(unified, kv_type, n, length))
        print(f"{n:2d} x {length:4d}: " + " | ".join(
            f"{k} {' '.join(f'{v:6.1f}' for v in vs)} tok/s" for k, vs in figures.items()),
            flush=True)


if __name__ == "__main__":
    main()
