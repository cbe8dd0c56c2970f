"""A later turn of a long conversation on the real model: its short final prompt chunk,
as it is or widened over the tokens the sequence holds (engine/chunking.py), answers as
the whole prompt evaluated from scratch does; and the build's flash attention tiles from
8 rows (scripts/llama-flash-attention.patch), so that aotx widens nothing."""

from __future__ import annotations

import os
import threading

import pytest

from aotx.engine import chunking
from aotx.engine.chunking import FA_TILE, ChunkCost, chunk_cost, fa_tile_min_rows
from aotx.engine.scheduler import Request, Scheduler

from ..unit.test_scheduler import run_until_idle, submit

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="model tests disabled")

STORY = " ".join(f"On day {d} the keeper of the lighthouse counted {d * 7 % 13} ships "
                 f"and wrote the number in a book." for d in range(1, 31))
FOLLOW_UP = ("And on day 5? Answer with the number, then say whether it was more ships than "
             "on day 3 or fewer.")


def test_the_build_tiles_flash_attention_from_8_rows() -> None:
    import llama_cpp  # noqa: F401  (loads libggml-cpu, where the patch reports itself)

    assert fa_tile_min_rows() == 8


def test_a_later_turn_is_widened_and_answers_as_the_whole_prompt_does() -> None:
    """The widening that an upstream build (tiles from 64 rows) gets: ``ChunkCost`` is
    made here whatever the build, since aotx's own widens nothing."""
    import llama_cpp

    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.llama import EngineConfig, LlamaEngine
    from aotx.engine.sampling import Sampler

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
            before = sched.prompt_tokens_in
            submit(sched, req)
            run_until_idle(sched)
            req.evaluated = sched.prompt_tokens_in - before  # type: ignore[attr-defined]
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
    widen.  And with a build that tiles from 8 rows (aotx's) nothing is widened at all."""
    from aotx.device.models import default_model_path
    from aotx.engine.llama import EngineConfig, LlamaEngine

    for kv_type, flash, widened in (("q8_0", False, False), ("f16", True, True),
                                    ("f16", False, False)):
        engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=2, slot_context=512,
                                          kv_type=kv_type, flash_attention=flash))
        try:
            assert engine.flash_attention is (flash or kv_type == "q8_0")
            assert chunk_cost(engine) is None  # this build: tiles from 8 rows
            with monkeypatch.context() as m:
                m.setattr(chunking, "fa_tile_min_rows", lambda: FA_TILE)  # upstream's
                assert (chunk_cost(engine) is not None) is widened
        finally:
            engine.close()
