"""A later turn of a long conversation on the real model: its short final prompt chunk,
as it is or widened over the tokens the sequence holds (engine/chunking.py), answers as
the whole prompt evaluated from scratch does; and the build's flash attention tiles every
chunk, one row or 512, the same to the bit (scripts/llama-flash-attention.patch), so that
aotx widens nothing."""

from __future__ import annotations

import os
import threading

import pytest

from aotx.engine.llama import chunking
from aotx.engine.llama.chunking import FA_TILE, ChunkCost, chunk_cost, fa_tile_min_rows
from aotx.engine.llama.scheduler import Request, Scheduler

from ..unit.test_scheduler import run_until_idle, submit

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="model tests disabled")

STORY = " ".join(f"On day {d} the keeper of the lighthouse counted {d * 7 % 13} ships "
                 f"and wrote the number in a book." for d in range(1, 31))
FOLLOW_UP = ("And on day 5? Answer with the number, then say whether it was more ships than "
             "on day 3 or fewer.")


def test_the_build_tiles_flash_attention_from_one_row() -> None:
    import llama_cpp  # noqa: F401  (loads libggml-cpu, where the patch reports itself)

    assert fa_tile_min_rows() == 1


def test_a_prompt_is_computed_the_same_whatever_its_chunks() -> None:
    """Flash attention on, a stream per sequence (the defaults): a 300-token prompt
    evaluated in chunks of 256, of 33, of 7, a row at a time, or cut unevenly, gives the
    same last logits to the bit, so neither the load (which sizes the chunks) nor a
    cached prefix changes an answer; and so does the same text's end decoded a row a
    step beside other streams, so a reply's cells, which a later turn reuses, are what
    the same text sent afresh computes.  Upstream's build and aotx's before 1-row
    tiles both fail this (the previous one by up to 0.86 at cuts of 7)."""
    import numpy as np

    from aotx.device.models import default_model_path
    from aotx.engine.interface import BatchEntry
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine

    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=6, slot_context=512))
    try:
        assert engine.flash_attention
        tokens = engine.tokenize(STORY, False)[:300]
        assert len(tokens) == 300

        def last_logits(cuts: list[int]) -> np.ndarray:
            engine.clear_sequence(1)
            start, i = 0, 0
            while start < len(tokens):
                part = tokens[start:start + cuts[i % len(cuts)]]
                i += 1
                assert engine.decode([BatchEntry(t, start + j, 1, start + j == len(tokens) - 1)
                                      for j, t in enumerate(part)]) == 0
                start += len(part)
            return engine.logits_rows([len(part) - 1])[0].copy()

        whole = last_logits([256])
        for cuts in ([33], [7], [1], [5, 1, 13], [299, 1]):
            assert np.array_equal(last_logits(cuts), whole), cuts

        # its last 60 tokens one a step beside four other streams, as a reply's tokens are
        # decoded: the cells a later turn reuses are what the text sent afresh computes
        engine.clear_sequence(1)
        assert engine.decode([BatchEntry(t, j, 1, False) for j, t in enumerate(tokens[:240])]) == 0
        others = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 30, False)
        for seq in range(2, 6):
            engine.clear_sequence(seq)
            assert engine.decode([BatchEntry(t, j, seq, False)
                                  for j, t in enumerate(others[:20 * seq])]) == 0
        for k in range(240, 300):
            batch = [BatchEntry(tokens[k], k, 1, True)] + [
                BatchEntry(others[k - 240 + seq], 20 * seq + k - 240, seq, True)
                for seq in range(2, 6)]
            assert engine.decode(batch) == 0
        assert np.array_equal(engine.logits_rows([0])[0], whole)
    finally:
        engine.close()


def test_a_later_turn_is_widened_and_answers_as_the_whole_prompt_does() -> None:
    """The widening that an upstream build (tiles from 64 rows) gets: ``ChunkCost`` is
    made here whatever the build, since aotx's own widens nothing."""
    import llama_cpp

    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine
    from aotx.engine.llama.sampling import Sampler

    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=2, slot_context=2048,
                                      batch=512))
    try:
        tmpl = ChatTemplate(engine.metadata("tokenizer.chat_template"))
        cost = ChunkCost.of(llama_cpp, engine.model)

        def scheduler(widen: bool) -> Scheduler:
            return Scheduler(engine, 2, 512, threading.Lock(),
                             make_sampler=lambda r: Sampler(0.0, 1.0, 0),
                             free_sampler=lambda s: s.free(), chunk_cost=cost if widen else None)

        def ask(sched: Scheduler, n: int, messages: list[dict[str, str]]) -> Request:
            prompt = engine.tokenize(tmpl.render(messages), False)
            req = Request(identity=bytes([n]) * 16, principal=1, revision=1, role=1,
                          prompt=prompt, max_tokens=24)
            before = sched.stats.prompt_tokens_in
            submit(sched, req)
            run_until_idle(sched)
            req.evaluated = sched.stats.prompt_tokens_in - before  # type: ignore[attr-defined]
            return req

        first_turn = [{"role": "user", "content": STORY + " How many ships on day 3?"}]
        answers = {}
        for widen in (False, True):
            for q in range(2):
                engine.clear_sequence(q)
            sched = scheduler(widen)
            first = ask(sched, 1, first_turn)
            history = first_turn + [{"role": "assistant", "content": bytes(first.out).decode()},
                                    {"role": "user", "content": FOLLOW_UP}]
            later = ask(sched, 2, history)
            new = len(later.prompt) - later.reused_tokens
            assert later.reused_tokens > 500 and new < FA_TILE  # a short chunk, deep
            assert cost.widen(new, later.reused_tokens, later.reused_tokens) > 0
            # widened: the chunk is long enough to tile; else only the new tokens
            assert later.evaluated == (FA_TILE + 1 if widen else new)  # type: ignore[attr-defined]
            answers[widen] = bytes(later.out)
        for q in range(2):
            engine.clear_sequence(q)
        fresh = ask(scheduler(True), 3, history)  # nothing held: the whole prompt
        assert fresh.reused_tokens == 0
        assert answers[True] == answers[False] == bytes(fresh.out) and fresh.out
    finally:
        engine.close()


def test_only_flash_attention_on_f16_cells_is_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    """ggml's tiled flash attention reads f16 or f32 cells only: with q8_0 a wider chunk
    would only cost more (65 tokens at depth 450: 303 ms, 33 tokens: 155).  Without flash
    attention (``flash_attention = false``) every chunk is a matrix product: nothing to
    widen.  And with a build that tiles every chunk (aotx's) nothing is widened at all."""
    from aotx.device.models import default_model_path
    from aotx.engine.llama.engine import EngineConfig, LlamaEngine

    for kv_type, flash, widened in (("q8_0", False, False), ("f16", True, True),
                                    ("f16", False, False)):
        engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=2, slot_context=512,
                                          kv_type=kv_type, flash_attention=flash))
        try:
            assert engine.flash_attention is (flash or kv_type == "q8_0")
            assert chunk_cost(engine) is None  # this build: tiles every chunk
            with monkeypatch.context() as m:
                m.setattr(chunking, "fa_tile_min_rows", lambda: FA_TILE)  # upstream's
                assert (chunk_cost(engine) is not None) is widened
        finally:
            engine.close()
