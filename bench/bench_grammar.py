"""Constrained decoding at the engine level: 8 sequences each under a JSON schema against
8 free ones, through the scheduler on the real model.

    .venv/bin/python -m bench.bench_grammar [--sequences 8] [--tokens 96] [--rounds 4]

Each round runs A (every sequence constrained) then B (none), so drift of this VM's
speed hits both alike (A B A B).  The schemas ask for long arrays (``minItems`` past
what fits), so constrained sequences sample exactly ``--tokens`` tokens; a free one may
end at EOS, so tok/s counts only the steps in which all sequences sampled (the same
batch size on both sides: the difference is the grammar's).  Prompts are evaluated
before the clock starts.  It prints per round the tok/s of each side, then the medians
and the ratio constrained / free as the median of the rounds' own ratios (this VM's
speed drifts by several times within a minute when its neighbours are busy: only
figures measured seconds apart compare), and
the masks' cost: the worker's fill time per step and per mask, the part of it the
engine thread still waited for after the decode (the cost on the critical path), and
``apply_mask`` per token (the -inf pass over the logits row, on the engine thread).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

from aotx.device.template import ChatTemplate
from aotx.engine.grammar import GrammarSpec, apply_mask, mask_words
from aotx.engine.llama.sampling import Sampler
from aotx.engine.llama.scheduler import Request, Scheduler
from bench import common

_PERSON = {"type": "object",
           "properties": {"name": {"type": "string", "maxLength": 12},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "role": {"enum": ["admin", "user", "guest"]}},
           "required": ["name", "age", "role"], "additionalProperties": False}
_ITEMS: list[dict[str, Any]] = [
    _PERSON,
    {"type": "string", "maxLength": 16},
    {"type": "integer", "minimum": -1000, "maximum": 1000},
    {"$ref": "#/$defs/point"},
    {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-z]{2,6}$"}]},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
     "minItems": 1, "maxItems": 3},
    {"enum": ["red", "green", "blue", "yellow"]},
    {"type": "string", "format": "date"},
]
_DEFS = {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                     "y": {"type": "integer"}},
                   "required": ["x", "y"], "additionalProperties": False}}


def schema(i: int) -> dict[str, Any]:
    """A different schema per sequence, each longer than any run (500 items)."""
    return {"type": "object", "$defs": _DEFS, "required": ["items"],
            "additionalProperties": False,
            "properties": {"items": {"type": "array", "items": _ITEMS[i % len(_ITEMS)],
                                     "minItems": 500}}}


def run(sched: Scheduler, reqs: list[Request]) -> tuple[float, int]:
    """(seconds, tokens) of the decode steps in which every sequence sampled: a free
    sequence may end early at EOS, and a smaller batch is slower per token, so only
    full steps compare like with like."""
    with sched.lock:
        for r in reqs:
            sched.submit(r)
    while any(r.sampled == 0 for r in reqs):  # prompts, and the first token
        sched.step()
    busy, tokens = 0.0, 0
    while True:
        t0 = time.perf_counter()
        out = sched.step()
        took = time.perf_counter() - t0
        if not out:
            return busy, tokens
        if out.sampled == len(reqs):
            busy += took
            tokens += out.sampled


def apply_cost(n_vocab: int) -> float:
    """Seconds per apply_mask over an n_vocab logits row (half the tokens allowed)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(n_vocab).astype(np.float32)
    bits = rng.integers(-2**31, 2**31 - 1, mask_words(n_vocab), dtype=np.int64).astype(np.int32)
    reps = 2000
    t0 = time.perf_counter()
    for _ in range(reps):
        apply_mask(logits, bits)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    n = args.sequences
    engine = common.engine(slots=n, slot_context=1024,
                           batch=512, threads=args.threads)
    t0 = time.perf_counter()
    compiler = engine.grammar_compiler()
    print(f"tokenizer for llguidance: {time.perf_counter() - t0:.2f} s (once per model)")
    specs = [GrammarSpec.json_schema(schema(i)) for i in range(n)]
    t0 = time.perf_counter()
    for s in specs:
        compiler.compile(s)
    print(f"compile: {(time.perf_counter() - t0) / n * 1e3:.2f} ms a schema; cached: ", end="")
    t0 = time.perf_counter()
    for s in specs:
        compiler.compile(s).matcher()
    print(f"{(time.perf_counter() - t0) / n * 1e6:.0f} us a schema (lookup and matcher copy)")
    tmpl = ChatTemplate(engine.metadata("tokenizer.chat_template"))
    sched = Scheduler(engine, n, 512, threading.Lock(),
                      make_sampler=lambda r: Sampler(r.temperature, r.top_p, r.seed),
                      free_sampler=lambda s: s.free())  # type: ignore[attr-defined]
    prompts = [engine.tokenize(tmpl.render([{"role": "user", "content":
               f"List many items as JSON (list {i})."}]), False) for i in range(n)]

    def batch(constrained: bool, k: int) -> list[Request]:
        return [Request(identity=bytes([k, i]) * 8, principal=1, revision=1, role=1,
                        prompt=prompts[i], max_tokens=args.tokens,
                        matcher=compiler.matcher(specs[i]) if constrained else None)
                for i in range(n)]

    a_rates, b_rates = [], []
    masks = sched.masks
    for k in range(args.rounds):
        fill0, wait0, steps0, masks0 = masks.fill_ns, masks.wait_ns, masks.steps, masks.masks
        secs, toks = run(sched, batch(True, 2 * k))
        a_rates.append(toks / secs)
        steps, nmask = max(1, masks.steps - steps0), max(1, masks.masks - masks0)
        fill, wait = (masks.fill_ns - fill0) / 1e6, (masks.wait_ns - wait0) / 1e6
        free = batch(False, 2 * k + 1)
        secs_b, toks_b = run(sched, free)
        b_rates.append(toks_b / secs_b)
        if any(r.sampled < args.tokens for r in free):
            print(f"  (free sequences ended at EOS: {[r.sampled for r in free]} tokens; "
                  f"only steps with all {n} count)")
        print(f"round {k + 1}: constrained {a_rates[-1]:.1f} tok/s, free {b_rates[-1]:.1f} "
              f"tok/s; masks: fill {fill / steps:.3f} ms/step ({fill / nmask * 1e3:.0f} us/mask), "
              f"waited {wait / steps:.3f} ms/step after decode, "
              f"step {secs / max(1, toks // n) * 1e3:.1f} ms")
    a, b = statistics.median(a_rates), statistics.median(b_rates)
    ratios = [x / y for x, y in zip(a_rates, b_rates, strict=True)]
    print(f"median: constrained {a:.1f} tok/s, free {b:.1f} tok/s; ratio constrained/free "
          f"{statistics.median(ratios):.3f} (the median of the rounds' "
          f"[{', '.join(f'{r:.2f}' for r in ratios)}]; {n} sequences, {args.tokens} tokens)")
    print(f"apply_mask: {apply_cost(engine.n_vocab) * 1e6:.1f} us per token "
          f"({engine.n_vocab} logits); worst step fill {masks.worst_fill_ns / 1e6:.2f} ms")
    masks.close()
    engine.close()


if __name__ == "__main__":
    main()
