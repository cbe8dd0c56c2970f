"""What the compiled-grammar cache costs in memory, on the real vocabulary.

    .venv/bin/python -m bench.bench_grammar_memory [--grammars 64] [--steps 64]

Fills the cache (``GrammarLimits.cache_size``, 64) with distinct schemas built to grow
llguidance's lexer: each has 24 string properties with patterns of their own, a
2000-value enum and nested arrays, all different per schema.  Each grammar is walked
``--steps`` tokens along a random path its masks allow (the lexer grows lazily, as
masks are computed), with a second matcher copy alive, as a cached grammar's requests
would.  It prints the process's resident set before and after, per grammar, and the
largest source a request may send (64 KiB) for scale.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from typing import Any

import numpy as np

from aotx.engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, mask_words
from bench import common


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def schema(i: int) -> dict[str, Any]:
    rnd = random.Random(i)
    letters = "abcdefghijklmnopqrstuvwxyz"
    props: dict[str, Any] = {}
    for k in range(24):
        a, b = rnd.sample(letters, 2)
        props[f"p{i}_{k}"] = {"type": "string",
                              "pattern": f"^[{a}-{max(a, b)}]{{2,{3 + k % 5}}}[0-9]{{1,3}}$"}
    props["kind"] = {"enum": [f"v{i}_{n}_{rnd.randrange(10**6)}" for n in range(2000)]}
    props["grid"] = {"type": "array", "maxItems": 4, "items": {
        "type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": -i,
                                                  "maximum": 1000 + i}}}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def walk(compiler: GrammarCompiler, spec: GrammarSpec, steps: int, rnd: random.Random
         ) -> list[Any]:
    """Compile, then sample ``steps`` allowed tokens; the matchers kept alive."""
    grammar = compiler.compile(spec)
    keep, m = [grammar.matcher()], grammar.matcher()
    row = np.empty(mask_words(compiler.n_vocab), dtype=np.int32)
    for _ in range(steps):
        m.fill(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:compiler.n_vocab]
        allowed = np.flatnonzero(bits)
        if not len(allowed) or not m.consume(int(rnd.choice(allowed))) or m.finished:
            break
    return [*keep, m]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grammars", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    engine = common.engine(slots=1, slot_context=64,
                           batch=64)
    compiler = engine.grammar_compiler()
    base = rss_mib()
    sizes, alive, rnd = [], [], random.Random(0)
    t0 = time.perf_counter()
    for i in range(args.grammars):
        source = json.dumps(schema(i))
        sizes.append(len(source))
        try:
            alive += walk(compiler, GrammarSpec.json_schema(schema(i)), args.steps, rnd)
        except GrammarError as exc:
            print(f"grammar {i}: refused ({exc.code}: {exc.detail[:80]})")
        if (i + 1) % 16 == 0:
            print(f"{i + 1} grammars: RSS {rss_mib():.1f} MiB "
                  f"(+{rss_mib() - base:.1f} over the loaded model and tokenizer)", flush=True)
    grew = rss_mib() - base
    print(f"\nsources {min(sizes)}-{max(sizes)} bytes; {args.grammars} grammars walked "
          f"{args.steps} tokens each in {time.perf_counter() - t0:.1f} s")
    print(f"RSS grew {grew:.1f} MiB: {grew / args.grammars:.2f} MiB per cached grammar "
          f"with its matchers")
    engine.close()


if __name__ == "__main__":
    main()
