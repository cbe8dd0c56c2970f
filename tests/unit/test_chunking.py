"""Final prompt chunks widened for CPU flash attention (engine/chunking.py): the cost
model's choices, and the scheduler cutting a held sequence back to evaluate them."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from aotx.engine.llama.chunking import FA_TILE, ChunkCost
from aotx.engine.llama.scheduler import Scheduler
from aotx.engine.multimodal import MediaSegment

from .test_scheduler import ScriptedEngine, req, run_until_idle, submit

# SmolLM2-135M's figures, as ChunkCost.of reads them from the model.
SMOLLM2 = ChunkCost(matmul=2 * 134_515_008, per_cell=2 * 30 * 9 * 2 * 64)


def test_the_model_follows_the_measured_chunks_at_depth_450() -> None:
    # measured (chunking.py): 16 tokens 124 ms, 33 tokens 248 ms, 64 tokens 210 ms
    assert SMOLLM2.widen(33, 450, 10_000) == FA_TILE + 1 - 33
    assert SMOLLM2.widen(16, 450, 10_000) == 0  # 16 rows cost less than a tile
    assert SMOLLM2.widen(33, 100, 10_000) == 0  # shallow: rows are cheap
    assert SMOLLM2.widen(16, 3000, 10_000) == FA_TILE + 1 - 16  # deep: a tile pays


def test_chunks_that_tile_already_or_cannot_reach_a_tile_stay() -> None:
    assert SMOLLM2.widen(FA_TILE + 1, 5000, 10_000) == 0
    assert SMOLLM2.widen(FA_TILE, 5000, 10_000) == 1  # 64 loses a row beside running streams
    assert SMOLLM2.widen(33, 5000, 20) == 0  # 53 held tokens would not make a tile
    assert SMOLLM2.widen(33, 5000, 0) == 0


@given(take=st.integers(1, 600), depth=st.integers(0, 100_000), room=st.integers(0, 1000))
def test_a_widened_chunk_is_one_tile_and_a_row_within_room(take: int, depth: int,
                                                            room: int) -> None:
    back = SMOLLM2.widen(take, depth, room)
    assert back == 0 or (take + back == FA_TILE + 1 and back <= room)


def scheduler(batch: int = 128) -> tuple[Scheduler, ScriptedEngine]:
    engine = ScriptedEngine()
    sched = Scheduler(engine, 1, batch, threading.Lock(), make_sampler=lambda r: r,
                      free_sampler=lambda s: None, encode=lambda seg: f"embd{seg.start}",
                      chunk_cost=ChunkCost(matmul=1.0, per_cell=1.0))
    return sched, engine


def later_turn(sched: Scheduler, engine: ScriptedEngine, new: int) -> list[int]:
    """A 600-token turn answered, then the next turn (``new`` more tokens) on the same
    sequence; the positions of the next turn's prompt entries, by step."""
    first = req(1, [7, 7, 7], prompt_len=600)
    submit(sched, first)
    run_until_idle(sched)
    later = req(2, [8], prompt_len=0)
    later.prompt = first.prompt + [7, 7, 7] + list(range(900, 900 + new))
    engine.steps.clear()
    submit(sched, later)
    run_until_idle(sched)
    assert later.reused_tokens == 603
    return [e.pos for e in engine.steps[0]]


def test_a_short_final_chunk_evaluates_held_tokens_again() -> None:
    sched, engine = scheduler()
    positions = later_turn(sched, engine, 30)
    assert positions == list(range(633 - FA_TILE - 1, 633))  # 65 tokens, ending at the prompt's
    assert engine.trims[-1] == (0, 633 - FA_TILE - 1)


def test_a_chunk_that_tiles_or_does_not_fit_the_step_is_not_widened() -> None:
    sched, engine = scheduler()
    assert later_turn(sched, engine, 70) == list(range(603, 673))
    sched, engine = scheduler(batch=40)  # no room in the step for 65
    assert later_turn(sched, engine, 30) == list(range(603, 633))


def test_a_chunk_is_not_widened_into_a_media_segment() -> None:
    sched, engine = scheduler()
    r = req(1, [7], prompt_len=700)
    r.segments = [MediaSegment(start=600, n_tokens=80, kind="image")]
    submit(sched, r)
    run_until_idle(sched)
    text = [[e.pos for e in s] for s in engine.steps if s]
    assert text[0] == list(range(0, 128))  # the text before the image, in batches
    # after the image (600..679) only its 20 text tokens: the image is not evaluated again
    assert text[-2] == list(range(680, 700))
