"""Prompt chunks sized for llama.cpp's CPU flash attention (``flash_attention = true``, the
default), and without it never a chunk of one row (:func:`widen_final`).

llama.cpp's CPU flash attention (ggml-cpu ``ops.cpp``) takes its tiled, GEMM-like path
only for micro-batches with at least ``GGML_FA_TILE_Q`` (64) query rows per KV stream;
below that it walks every cached cell once per query row, one row at a time.  With a
KV stream per sequence (aotx's default), the rows of a stream are its own new tokens,
so a later turn of a long conversation (30 new tokens at depth 450) takes the slow path:
measured on the embedded model at depth 450, a 33-token chunk took 248 ms, a 63-token one
470 ms and a 64-token one 210 ms (``bench/bench_chunking.py``).

So a prompt's last chunk of fewer than 65 tokens (64 would lose one row to a micro-batch
shared with running sequences: llama.cpp splits a multi-stream batch into equal rows per
stream) is widened backwards over tokens the sequence already holds, when the cost model
below says the longer chunk is cheaper: the cells are cut back and those tokens are
evaluated again, with the same tokens at the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llama_cpp

if TYPE_CHECKING:
    from .interface import Engine
    from .llama import LlamaEngine
    from .request import Request

#: ggml-cpu's GGML_FA_TILE_Q: query rows per stream from which flash attention tiles.
FA_TILE = 64
#: How much slower the row-at-a-time path is per attended cell than the tiled one (and
#: than the model's matrix products) on the reference machine: a cell costs 10.7 µs a
#: token that way and 1.1 µs tiled, where SmolLM2-135M's matrix products cost 2.7 ms
#: a token (0.27 GFLOP at about 100 GFLOP/s; 69 kFLOP a cell at 6.5 GFLOP/s one row at
#: a time, 63 GFLOP/s tiled).
ROW_SLOWDOWN = 15.0


@dataclass(frozen=True)
class ChunkCost:
    """A token's cost in FLOPs: ``matmul`` for the weights, ``per_cell`` for each
    cached cell its attention reads (at the tiled path's efficiency)."""

    matmul: float
    per_cell: float

    @classmethod
    def of(cls, lib: Any, model: Any) -> ChunkCost:
        """From a llama.cpp model: two FLOPs a parameter; per cell, every layer's query
        heads take a key and a value row (n_embd / n_head wide each), two FLOPs a
        product."""
        heads = max(1, int(lib.llama_model_n_head(model)))
        head_dim = int(lib.llama_model_n_embd(model)) / heads
        return cls(matmul=2.0 * int(lib.llama_model_n_params(model)),
                   per_cell=2.0 * int(lib.llama_model_n_layer(model)) * heads * 2 * head_dim)

    def widen(self, take: int, depth: int, room: int) -> int:
        """How many held tokens before a final chunk of ``take`` tokens at ``depth`` to
        evaluate again (at most ``room``), so that it takes the tiled path: 0 when the
        chunk is tiled already, cannot reach a tile, or would cost more widened."""
        back = min(FA_TILE + 1 - take, room)
        if take > FA_TILE or back <= 0 or take + back <= FA_TILE:
            return 0
        rows = take * (self.matmul + ROW_SLOWDOWN * depth * self.per_cell)
        tiled = (take + back) * (self.matmul + depth * self.per_cell)
        return back if tiled < rows else 0

    def widen_held(self, engine: Engine, req: Request, take: int, budget: int) -> int:
        """Move the start of ``req``'s final prompt chunk of ``take`` tokens back over
        text it holds, within the step's ``budget``, where that costs less; how many
        tokens it moved back."""
        return move_back(engine, req, self.widen(take, req.n_past,
                                                 held_room(req, take, budget)))


def widen_final(engine: Engine, req: Request, take: int, budget: int,
                cost: ChunkCost | None) -> int:
    """How many held tokens to evaluate again with ``req``'s final chunk of ``take``
    (cut back already): where flash attention tiles from 64 rows, as ``cost`` says; else
    one, to a chunk of one row: llama.cpp computes a row alone otherwise than among
    others (its logits differ at depth 586, not with two rows), so a prompt cached but
    for its last token would answer otherwise than the same prompt evaluated afresh."""
    if cost is not None:
        return cost.widen_held(engine, req, take, budget)
    return move_back(engine, req, min(1, held_room(req, take, budget))) if take == 1 else 0


def held_room(req: Request, take: int, budget: int) -> int:
    """How many tokens ``req`` holds before a chunk of ``take`` that could be evaluated
    again with it, within ``budget``: text only, never into a media segment."""
    done = req.segments[req.next_segment - 1] if req.next_segment else None
    return min(budget - take, req.n_past - (done.start + done.n_tokens if done else 0))


def move_back(engine: Engine, req: Request, back: int) -> int:
    """Cut ``req``'s cells back by ``back`` tokens, to be evaluated again with its next
    chunk (the same tokens at the same positions); how many it moved back (0 where the
    cells cannot be cut back)."""
    if back <= 0 or not engine.trim_sequence(req.seq, req.n_past - back):
        return 0
    req.n_past -= back
    return back


def chunk_cost(engine: LlamaEngine) -> ChunkCost | None:
    """The cost model for a model whose chunks are widened: with flash attention
    (``flash_attention = true``: without it every chunk is a matrix product), a KV stream
    per sequence (not one pool), on the CPU, with an f16 cache (the tiled path reads
    only f16 or f32 cells: with q8_0 a 65-token chunk at depth 450 took 303 ms, a
    33-token one 155), where cut-back cells can be evaluated again (not a recurrent or
    hybrid model's state, not a sliding window's)."""
    lib, model = llama_cpp, engine.model
    c = engine.config
    if (not engine.flash_attention or c.unified or c.gpu_layers or c.kv_type != "f16"
            or engine.n_swa or lib.llama_model_is_recurrent(model)
            or lib.llama_model_is_hybrid(model)):
        return None
    return ChunkCost.of(lib, model)
