"""The engine layer on the real model: greedy sampling without a llama.cpp chain."""

from __future__ import annotations

import os
from collections.abc import Iterator

import llama_cpp
import pytest

from aotx.engine import BatchEntry, EngineConfig, EngineError, LlamaEngine, Sampler

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="model tests disabled")


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    from aotx.models import default_model_path

    eng = LlamaEngine(EngineConfig(path=default_model_path(), slots=4, slot_context=256,
                                   batch=128))
    yield eng
    eng.close()


def test_greedy_argmax_picks_what_llama_cpp_greedy_sampler_picks(engine: LlamaEngine) -> None:
    """Four sequences decoded together for 24 steps: at every step and for every
    batch entry, the arg-max fast path (temperature 0) returns the token that
    llama.cpp's own greedy sampler returns from the same logits."""
    fast = Sampler(0.0, 1.0, 0)
    assert fast.ptr is None  # no llama.cpp chain for temperature 0
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    prompts = [engine.tokenize(text, False) for text in (
        "The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):")]
    try:
        for q in range(4):
            engine.clear_sequence(q)
        entries = [BatchEntry(tok, i, q, i == len(p) - 1)
                   for q, p in enumerate(prompts) for i, tok in enumerate(p)]
        assert engine.decode(entries) == 0
        index = [i for i, e in enumerate(entries) if e.logits]
        pos = [len(p) for p in prompts]
        picked: list[list[int]] = [[] for _ in prompts]
        for _ in range(24):
            step = []
            for q, idx in enumerate(index):
                token = engine.sample(fast, idx)
                assert token == int(llama_cpp.llama_sampler_sample(chain, engine.ctx, idx))
                picked[q].append(token)
                step.append(BatchEntry(token, pos[q], q, True))
                pos[q] += 1
            assert engine.decode(step) == 0
            index = list(range(len(step)))
        # the four continuations differ (the check above compared real, distinct rows)
        assert len({tuple(p) for p in picked}) == 4
    finally:
        llama_cpp.llama_sampler_free(chain)
        fast.free()


def test_sampling_a_row_without_logits_is_an_error(engine: LlamaEngine) -> None:
    engine.clear_sequence(0)
    assert engine.decode([BatchEntry(1, 0, 0, True)]) == 0
    with pytest.raises(EngineError):
        engine.sample(Sampler(0.0, 1.0, 0), 5)  # only entry 0 asked for logits
