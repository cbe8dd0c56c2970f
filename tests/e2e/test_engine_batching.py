"""The scheduler on the real model through llama.cpp: sequences batched together, prefix
reuse and copied prefixes give the same output with fewer tokens evaluated."""

from __future__ import annotations

import os
import threading

import pytest

from aotx.engine.llama.chunking import apart_rows
from aotx.engine.llama.scheduler import Request, Scheduler
from aotx.wire import Phase

from ..unit.test_scheduler import run_until_idle, submit


@pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1", reason="model tests disabled")
def test_real_engine_batches_sequences_together() -> None:
    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine
    from aotx.engine.llama.sampling import Sampler

    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=4, slot_context=512,
                                      batch=256))
    try:
        tmpl = ChatTemplate(engine.metadata("tokenizer.chat_template"))
        sched = Scheduler(engine, 4, 256, threading.Lock(),
                          make_sampler=lambda r: Sampler(r.temperature, r.top_p, r.seed),
                          free_sampler=lambda s: s.free(), apart_rows=apart_rows(engine))
        reqs = []
        for i, q in enumerate(["Name a color.", "Count to five.", "Say hello.", "Name a fruit."]):
            prompt = engine.tokenize(tmpl.render([{"role": "user", "content": q}]), False)
            reqs.append(Request(identity=bytes([i]) * 16, principal=1, revision=1, role=1,
                                prompt=prompt, max_tokens=16))
        for r in reqs:
            submit(sched, r)
        steps = run_until_idle(sched)
        sampled = sum(r.sampled for r in reqs)
        assert all(r.phase is Phase.COMPLETED for r in reqs)
        assert all(r.out for r in reqs)
        # Four sequences decoding together need about as many steps as the longest
        # one alone (plus a step for each later prompt: one is evaluated at a time, in
        # a step of its own beside running streams), far fewer than the sum of their tokens.
        assert steps <= max(r.sampled for r in reqs) + 2 * len(reqs)
        assert steps < sampled
        n_prompt, n_gen = engine.perf()
        assert n_prompt + n_gen > 0
    finally:
        engine.close()


@pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1", reason="model tests disabled")
def test_real_engine_prefix_reuse_evaluates_fewer_tokens_with_the_same_output() -> None:
    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine
    from aotx.engine.llama.sampling import Sampler

    def engine_and_scheduler(slots: int) -> tuple[LlamaEngine, Scheduler]:
        eng = LlamaEngine(EngineConfig(path=default_model_path(), slots=slots, slot_context=512,
                                       batch=256))
        sch = Scheduler(eng, slots, 256, threading.Lock(),
                        make_sampler=lambda r: Sampler(0.0, 1.0, 0), free_sampler=lambda s: s.free(),
                        apart_rows=apart_rows(eng))
        return eng, sch

    def request(eng: LlamaEngine, n: int, question: str) -> Request:
        tmpl = ChatTemplate(eng.metadata("tokenizer.chat_template"))
        prompt = eng.tokenize(tmpl.render([{"role": "user", "content": question}]), False)
        return Request(identity=bytes([n]) * 16, principal=1, revision=1, role=1, prompt=prompt,
                       max_tokens=24)

    eng, sched = engine_and_scheduler(slots=1)
    try:
        first = request(eng, 1, "Name a fruit.")
        submit(sched, first)
        run_until_idle(sched)
        p_first = eng.perf()[0]
        second = request(eng, 2, "Name a color.")  # the same default system prompt
        submit(sched, second)
        run_until_idle(sched)
        p_second = eng.perf()[0] - p_first
        assert second.reused_tokens > 10  # the shared system prompt
        assert p_second < p_first
        assert p_second <= len(second.prompt) - second.reused_tokens + second.sampled
    finally:
        eng.close()
    fresh, fresh_sched = engine_and_scheduler(slots=1)
    try:
        alone = request(fresh, 3, "Name a color.")
        submit(fresh_sched, alone)
        run_until_idle(fresh_sched)
        assert alone.reused_tokens == 0
        assert bytes(alone.out) == bytes(second.out) and alone.out
    finally:
        fresh.close()


@pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1", reason="model tests disabled")
def test_real_engine_copied_prefix_gives_the_same_output() -> None:
    """Requests arriving together share the chat template's system prompt through the warm
    sequence and stream copies: fewer prompt tokens evaluated, identical greedy output."""
    from aotx.device.loading import template_prefix
    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine
    from aotx.engine.llama.sampling import Sampler

    questions = ["Name a fruit.", "Name a color.", "Name a planet."]

    def serve(warm: bool, copy: bool) -> tuple[list[bytes], int, int]:
        eng = LlamaEngine(EngineConfig(path=default_model_path(), slots=4, slot_context=512,
                                       batch=256))
        try:
            tmpl = ChatTemplate(eng.metadata("tokenizer.chat_template"))
            sch = Scheduler(eng, 4, 256, threading.Lock(),
                            make_sampler=lambda r: Sampler(0.0, 1.0, 0),
                            free_sampler=lambda s: s.free(), apart_rows=apart_rows(eng))
            if not copy:  # (all start at once: no request has evaluated a prefix to copy)
                sch.engine = _NoCopy(eng)  # type: ignore[assignment]
                sch.prompts_per_step = 0
            if warm:
                sch.warm(template_prefix(eng, tmpl))
            reqs = [Request(identity=bytes([i]) * 16, principal=1, revision=1, role=1,
                            prompt=eng.tokenize(tmpl.render([{"role": "user", "content": q}]),
                                                False), max_tokens=12)
                    for i, q in enumerate(questions)]
            for r in reqs:
                submit(sch, r)
            run_until_idle(sch)
            return [bytes(r.out) for r in reqs], eng.perf()[0], sch.copies
        finally:
            eng.close()

    plain, evaluated_plain, _ = serve(warm=False, copy=False)
    shared, evaluated_shared, copies = serve(warm=True, copy=True)
    assert all(plain) and shared == plain
    assert copies == 2  # the second and third request copied the first one's prefix
    assert evaluated_shared < evaluated_plain - 2 * 16


class _NoCopy:
    """An engine wrapper that refuses to be a copy source (copies fall back to evaluating)."""

    def __init__(self, engine: object) -> None:
        self._e = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self._e, name)

    def copy_sequence(self, src: int, dst: int) -> None:
        raise AssertionError("no copies in this run")


@pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1", reason="model tests disabled")
def test_a_stream_per_sequence_answers_the_same_beside_others_as_alone() -> None:
    """The default KV layout's promise (docs/operations.md, "Memory sizing"): a greedy
    answer does not depend on what else runs.  Five prompts, each evaluated in a
    ``llama_decode`` of its own as the scheduler does (``apart_rows``), then decoded
    together, give the tokens each gives alone.  (A shared pool does not keep this: its
    answers first differ at tokens 4 to 23, docs/history/performance-2026-12.md.)"""
    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.interface import BatchEntry
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine
    from aotx.engine.llama.sampling import Sampler

    questions = ["Tell me a short story about a cat.", "Describe the sea in a few sentences.",
                 "Write a short poem about the moon.", "Explain how rain forms.",
                 "Tell me about the history of bread."]
    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=5, slot_context=512))
    tmpl = ChatTemplate(engine.metadata("tokenizer.chat_template"))

    def greedy(qs: list[str], steps: int = 32) -> list[list[int]]:
        for q in range(5):
            engine.clear_sequence(q)
        prompts = [engine.tokenize(tmpl.render([{"role": "user", "content": q}]), False)
                   for q in qs]
        samplers = [Sampler(0.0, 1.0, 0) for _ in qs]
        out = []
        for s, p in enumerate(prompts):
            assert engine.decode([BatchEntry(tok, i, s, i == len(p) - 1)
                                  for i, tok in enumerate(p)]) == 0
            out.append([engine.sample(samplers[s], len(p) - 1)])
        for k in range(steps):
            assert engine.decode([BatchEntry(out[s][-1], len(prompts[s]) + k, s, True)
                                  for s in range(len(qs))]) == 0
            for s in range(len(qs)):
                out[s].append(engine.sample(samplers[s], s))
        return out

    try:
        assert greedy(questions) == [greedy([q])[0] for q in questions]
    finally:
        engine.close()


@pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1", reason="model tests disabled")
def test_a_prompts_logits_do_not_depend_on_its_chunks_or_its_neighbours() -> None:
    """Without flash attention (``flash_attention = false``), a long prompt's last logits
    are the same bit for bit however it is cut into chunks (the cached prefix and the
    batch decide that) and whatever streams decode between its chunks, at any depth (the
    scheduler then gives a prompt's chunks steps of their own, never of one row).  With
    flash attention they are not, and greedy answers of 600-token prompts change with
    the load."""
    from aotx.device.models import default_model_path
    from aotx.engine.interface import BatchEntry
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine

    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=3, slot_context=2048,
                                      batch=1024, flash_attention=False))
    colors = ["red", "blue", "green"]
    prompt = engine.tokenize(" ".join(f"Item {i} is colored {colors[i % 3]}." for i in range(70))
                             + " What color is item 7?", True)
    neighbour = engine.tokenize("Count from one to five hundred: " + "one two three " * 400,
                                True)
    assert len(prompt) > 550 and len(neighbour) > 1000
    assert not engine.flash_attention

    def last_logits(cuts: list[int], beside: bool) -> bytes:
        engine.clear_sequence(1)
        start = 0
        for k, end in enumerate([*cuts, len(prompt)]):
            if beside:  # the deeper streams' step between two of the prompt's chunks
                assert engine.decode([BatchEntry(neighbour[k % 7], len(neighbour) + k, seq, True)
                                      for seq in (0, 2)]) == 0
            chunk = [BatchEntry(prompt[i], i, 1, i == len(prompt) - 1) for i in range(start, end)]
            assert engine.decode(chunk) == 0
            start = end
        for seq in (0, 2):
            assert engine.trim_sequence(seq, len(neighbour))
        return engine.logits_rows([len(chunk) - 1]).tobytes()

    try:
        for seq in (0, 2):  # a deeper stream on each side of the prompt's sequence
            for at in range(0, len(neighbour), 512):
                assert engine.decode([BatchEntry(t, at + i, seq, False)
                                      for i, t in enumerate(neighbour[at:at + 512])]) == 0
        alone = last_logits([512], beside=False)  # how a quiet step cuts it
        for cuts in ([], [1], [100], [300, 301], [len(prompt) - 2], [509], [450, 500]):
            for beside in (False, True):
                assert last_logits(cuts, beside) == alone, (cuts, beside)
    finally:
        engine.close()
