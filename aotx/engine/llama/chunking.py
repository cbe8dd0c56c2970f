"""Prompt chunks sized for llama.cpp's CPU flash attention (``flash_attention = true``, the
default) and for answers that do not depend on the load (:func:`widen_final`).

Upstream llama.cpp's CPU flash attention (ggml-cpu ``ops.cpp``) takes its tiled,
GEMM-like path only for micro-batches with at least ``GGML_FA_TILE_Q`` (64) query rows
per KV stream; below that it walks every cached cell once per query row.  With a KV
stream per sequence (aotx's default), a later turn of a long conversation (30 new
tokens at depth 450) took that path: a 33-token chunk 248 ms, a 64-token one 210
(``bench/bench_chunking.py``).  aotx's build (scripts/llama-flash-attention.patch) tiles
every chunk, from one row, each row the same bits whatever chunk it came in, and says so
(:func:`fa_tile_min_rows`: 1).

- **aotx's build, or no flash attention** (:func:`apart_rows`: 1, or 2): prompt chunks
  get steps of their own, one prompt a step; without flash attention a final chunk of
  one row also takes the held token before it, so that every prompt row is computed as
  the same prompt's rows are when it is evaluated afresh (on aotx's build every chunk
  already is).
- **An upstream build with flash attention** (:func:`chunk_cost`): a prompt's last
  chunk of fewer than 65 tokens (64 would lose one row to a micro-batch shared with
  running sequences: llama.cpp splits a multi-stream batch into equal rows per stream)
  is widened to 65 where the cost model below says that is cheaper.

Either way the cells are cut back and those tokens evaluated again, with the same
tokens at the same positions.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llama_cpp

from .libs import loaded_library

if TYPE_CHECKING:
    from ..interface import Engine
    from ..request import Request
    from .engine import LlamaEngine

#: ggml-cpu's GGML_FA_TILE_Q: query rows per stream from which upstream flash attention
#: tiles.  aotx's build (scripts/setup, scripts/llama-flash-attention.patch) tiles every
#: chunk, from one row.
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
                cost: ChunkCost | None, rows: int = 2) -> int:
    """How many held tokens to evaluate again with ``req``'s final chunk of ``take``
    (cut back already): where flash attention tiles from 64 rows, as ``cost`` says; else
    enough for ``rows`` rows (:func:`apart_rows`), where the prompt holds them: a chunk of
    fewer is computed otherwise than a fresh prompt's rows are, so a prompt cached but
    for its last tokens would answer otherwise than the same prompt evaluated afresh."""
    if cost is not None:
        return cost.widen_held(engine, req, take, budget)
    if take >= rows:
        return 0
    return move_back(engine, req, min(rows - take, held_room(req, take, budget)))


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


@functools.cache
def fa_tile_min_rows() -> int:
    """Query rows per KV stream from which the loaded ggml-cpu's flash attention tiles:
    1 where built with aotx's patch (it says so through ``ggml_cpu_fa_tile_min_rows``),
    else upstream's 64."""
    try:
        lib = ctypes.CDLL(loaded_library("libggml-cpu.so"))
    except OSError:  # a build without a CPU backend of that name
        return FA_TILE
    report = getattr(lib, "ggml_cpu_fa_tile_min_rows", None)
    if report is None:
        return FA_TILE
    report.restype, report.argtypes = ctypes.c_int, []
    return int(report())


def _tiles(engine: LlamaEngine) -> bool:
    """Does ``engine`` evaluate prompt chunks with the CPU's flash attention over f16
    cells in a KV stream per sequence (the default), whose cut-back cells can be
    evaluated again?  Not without flash attention (every chunk is a matrix product), not
    in one pool, not on a GPU, not with a ``q8_0`` cache (the tiled path reads only f16
    or f32 cells), not for a recurrent or hybrid model's state or a sliding window's."""
    lib, model, c = llama_cpp, engine.model, engine.config
    return not (not engine.flash_attention or c.unified or c.gpu_layers or c.kv_type != "f16"
                or engine.n_swa or lib.llama_model_is_recurrent(model)
                or lib.llama_model_is_hybrid(model))


def chunk_cost(engine: LlamaEngine) -> ChunkCost | None:
    """The cost model for a model whose final chunks are widened to a tile: where
    :func:`_tiles` and the library tiles only from 64 rows (with q8_0 a 65-token chunk at
    depth 450 took 303 ms, a 33-token one 155).  On aotx's build every chunk tiles as it
    is, with no padding: nothing to widen."""
    if fa_tile_min_rows() < FA_TILE or not _tiles(engine):
        return None
    return ChunkCost.of(llama_cpp, engine.model)


def apart_rows(engine: LlamaEngine) -> int:
    """The fewest rows a final prompt chunk has, its prompt permitting, with prompt
    chunks in ``llama_decode`` calls of their own (``Scheduler.apart_rows``); 0: no
    such rule.  So that an answer does not depend on the load or on what was cached:
    llama.cpp splits a batch into micro-batches of equal rows per stream (a prompt's
    first row would go with the running streams' one each), and computes a row alone
    otherwise than among others.  Without flash attention, 2.  With it, on aotx's
    build, 1 (what ``ggml_cpu_fa_tile_min_rows`` reports): every chunk, one row or
    many, is tiled and each row computed the same whatever else shares its tile, so
    only the steps apart remain (a build that tiled from 8 rows got 8).  On an upstream
    build, 0: chunks below 64 rows take the row path alone or beside others."""
    if not engine.flash_attention:
        return 2
    return fa_tile_min_rows() if fa_tile_min_rows() < FA_TILE and _tiles(engine) else 0
