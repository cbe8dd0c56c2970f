"""Continuous batching over one llama.cpp engine: the step (this module), what it holds
(plan.py), and which sequence a request starts in, with the KV cells (cache.py).

Each call to :meth:`Scheduler.step` is one ``llama_decode``: one token for every
running sequence and prompt chunks of sequences being prepared (or the two in turns).
Requests join between steps (when a sequence, a KV stream, is free) and leave between
steps; cancellation is a flag on the request, never touching the sequence's next user.

Locking: the device lock guards every request field the control thread reads, held
while a step is planned and its results applied, never during ``llama_decode``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...wire import EngineFeature, Finish, Phase, Sampling
from ..accept import accept
from ..fair import FairQueue, owner_of
from ..grammar import MaskFiller
from ..interface import BatchEntry, Engine, EngineError, EngineStats, Side, StepOutcome
from ..logprobs import annotate
from ..multimodal import MediaInputError, MediaSegment, release_all
from ..output import OutputBuffer
from ..request import Failure, Request, settle
from .chunking import ChunkCost
from .kvpool import KvPool
from .plan import StepPlan
from .spill import SpillStore

__all__ = ["Failure", "OutputBuffer", "Request", "Scheduler", "StepOutcome"]

SamplerFactory = Callable[[Request], object]


class Scheduler(StepPlan):
    """Continuous batching over one llama.cpp engine (module docstring); what a step holds
    is plan.py's, which sequence a request starts in and the KV cells cache.py's."""

    def __init__(self, engine: Engine, slots: int, batch: int, lock: threading.Lock,
                 make_sampler: SamplerFactory, free_sampler: Callable[[object], None],
                 on_step: Callable[[], None] = lambda: None,
                 on_terminal: Callable[[Request], None] = lambda r: None,
                 encode: Callable[[MediaSegment], Any] | None = None,
                 prompts_per_step: int = 1, spill_bytes: int = 0,
                 chunk_cost: ChunkCost | None = None, apart_rows: int = 0) -> None:
        self.engine, self.apart_rows = engine, apart_rows  # chunking.apart_rows; _choose
        # Widened chunks (chunking.py) only one prompt a step: llama.cpp splits two prompts
        self.chunk_cost = chunk_cost if prompts_per_step == 1 else None  # into equal rows
        self.batch = batch
        # How many requests evaluate their prompts at once (0: all that arrive).  On a CPU
        # a prompt token costs the same alone or beside others (2.7 ms here), so one after
        # another the first samples sooner and the last no later; and a request waiting to
        # start copies the prefix (a shared system prompt) the one before it evaluated.
        self.prompts_per_step = prompts_per_step
        self._prompt_turn, self.lock = True, lock  # _prompt_turn: see _choose
        self.cond = threading.Condition(lock)
        self.queue: FairQueue[Request] = FairQueue()  # one FIFO per principal (fair.py)
        self.active: list[Request] = []  # preparing or running, in admission order
        self.free_seqs = list(range(slots - 1, -1, -1))
        self.make_sampler = make_sampler
        self.free_sampler = free_sampler
        self.on_step = on_step
        self.on_terminal = on_terminal
        self.encode = encode
        self.media_decoded = 0  # media segments decoded into sequences
        self.tick = self.steps_with_tokens = self.tokens_decoded = 0
        # Prompt tokens evaluated; looked up in the cached prefixes, and found there.
        self.prompt_tokens_looked_up = self.reused_tokens = 0
        self.copies = 0  # prefixes copied from a sequence in use
        self.cached: dict[int, list[int]] = {}  # seq -> tokens held in its KV cells
        self.owner: dict[int, int] = {}  # seq -> whose request computed them (fair.owner_of)
        self.public: list[int] = []  # the template's fixed start: anybody may reuse it
        self.stats = EngineStats()  # counts and latencies (the device's /metrics)
        self._ended: list[Request] = []  # the step's terminal requests (StepOutcome.ended)
        self.masks = MaskFiller()  # constrained requests' bitmasks, filled during the decode
        self.pool = KvPool(engine.kv_cells, getattr(engine, "unified", True))
        self.spill = SpillStore(spill_bytes)  # cached prefixes in host memory (spill.py)
        self._stopping = False
        self.side: Side | None = None
        self.on_fatal: Callable[[str], None] = lambda why: None  # (a step's failure fails
        # its requests, not the engine: nothing calls it here)

    # -- called with the lock held (control thread) -------------------------
    def submit(self, req: Request) -> None:
        req.phase = Phase.QUEUED
        self.queue.append(req)
        self.cond.notify()

    def cancel(self, req: Request) -> None:
        if not req.phase.terminal:
            req.cancel_requested = True
            self.cond.notify()

    @property
    def depth(self) -> int:
        return len(self.queue) + len(self.active)

    def unsupported(self, sampling: Sampling) -> EngineFeature | None:
        return None  # llama.cpp's sampler chain does every sampling field

    def add_adapter(self, role: int, alias: str, path: str) -> None:
        raise EngineError(f"{alias}: LoRA adapters are served on vLLM models only")

    def engine_metrics(self) -> dict[str, object]:
        """The grammar masks' and the KV cache's figures (the device's /metrics), and the
        ones a router's scorers read from vLLM (docs/scale-out.md): running and waiting
        requests, the share of KV cells held, prompt tokens looked up in and found in
        cached prefixes."""
        used = self.pool.in_use(self.active, self.cached, self.free_seqs)
        return {"grammar_steps": self.masks.steps, "grammar_masks": self.masks.masks,
                "grammar_fill_seconds": self.masks.fill_ns / 1e9,
                "grammar_wait_seconds": self.masks.wait_ns / 1e9,
                "kv_budget_bytes": self.engine.kv_bytes(), "kv_cells": self.engine.kv_cells,
                "kv_cells_used": used, "grammar_deferred": self.masks.deferred,
                "kv_preemptions": self.pool.preemptions, "kv_evictions": self.pool.evictions,
                "kv_spilled_bytes": self.spill.bytes, "kv_spills": self.spill.spills,
                "kv_restores": self.spill.restores,
                "num_requests_running": len(self.active), "num_requests_waiting": len(self.queue),
                "kv_cache_usage_perc": min(1.0, used / max(1, self.engine.kv_cells)),
                "prefix_cache_queries": self.prompt_tokens_looked_up,
                "prefix_cache_hits": self.reused_tokens,
                **dict(zip(("engine_threads", "engine_thread_changes"),
                           self.engine.thread_figures(), strict=True))}

    # -- engine thread -------------------------------------------------------
    def _finish(self, req: Request, phase: Phase, finish: Finish = Finish.NONE,
                failure: Failure = Failure.NONE) -> None:
        settle(req, phase, finish, failure)
        if not req.background:  # policy work is not a request anybody admitted
            self.stats.finished[phase.name.lower()] += 1
        if req.seq >= 0:
            # Keep the sequence's KV cells: the next request assigned to this
            # sequence reuses the longest common prefix (prompt caching).  A
            # failed decode leaves the cells in an unknown state: clear them.
            if phase is Phase.FAILED:
                self.engine.clear_sequence(req.seq)
                self.cached[req.seq] = []
            else:
                self.cached[req.seq] = (req.prompt + req.generated)[:req.n_past]
            self.owner[req.seq] = owner_of(req)
            self.pool.freed_at[req.seq] = self.tick
            self.pool.ended += 1
            self.free_seqs.append(req.seq)
            req.seq = -1
        if req.sampler is not None:
            self.free_sampler(req.sampler)
            req.sampler = None
        release_all(req.segments)
        self._ended.append(req)
        self.on_terminal(req)

    def _decode_media(self, req: Request, seg: MediaSegment) -> None:
        """Encode one media segment and decode its embeddings into the request's sequence."""
        failure = Failure.NONE
        try:
            if self.encode is None:
                raise MediaInputError("this model has no projector")
            embd = self.encode(seg)
            status = self.engine.decode_embeddings(embd, seg.n_tokens, seg.start, req.seq,
                                                   seg.non_causal)
            if status != 0:
                failure = Failure.NO_MEMORY if status == 1 else Failure.DECODE
        except MediaInputError:
            failure = Failure.MEDIA
        with self.lock:
            if failure is Failure.NONE:
                req.n_past += seg.n_tokens
                req.next_segment += 1
                self.stats.prompt_tokens_in += seg.n_tokens
                self.media_decoded += 1
            elif (failure is Failure.NO_MEMORY and self.pool.shared and req in self.active
                  and self.engine.trim_sequence(req.seq, req.n_past) and self._relieve()):
                pass  # cells were given back: the segment is decoded again next step
            elif req in self.active:
                self.active.remove(req)
                self._finish(req, Phase.FAILED, failure=failure)

    def step(self) -> StepOutcome:
        """Run one decode step; the outcome is falsy when there was nothing to do."""
        with self.lock:
            self._ended = []
            entries, samples, advances, media = self._plan()
        out = StepOutcome(ran=bool(entries or media), media=media is not None,
                          tokens=len(entries), ended=self._ended)
        if media is not None:
            self._decode_media(*media)
        if entries:
            # Constrained samples' masks are computed while the decode runs (both drop
            # the GIL); a step without any costs one pass over its samples.
            constrained = [r.matcher for r, _ in samples if r.matcher is not None]
            if constrained:
                self.masks.start(constrained)
            status = self.engine.decode(entries)
            bits = self.masks.wait() if constrained else None
            if status != 0:
                with self.lock:
                    if status == 1 and self.pool.shared and self._relieve():  # plan again
                        self.tick += 1
                        return out
                    for req, _ in advances:
                        if req in self.active:
                            self.active.remove(req)
                            self._finish(req, Phase.FAILED, failure=Failure.NO_MEMORY
                                         if status == 1 else Failure.DECODE)
                    self.tick += 1
            else:
                out.sampled = self._sample(entries, samples, advances, bits)
        elif media is not None:
            with self.lock:
                self.tick += 1
        if out.ran:
            self.on_step()
        return out

    def _sample(self, entries: list[BatchEntry], samples: list[tuple[Request, int]],
                advances: list[tuple[Request, int]], bits: Any = None) -> int:
        """Sample after a decode that succeeded, and apply the step to its requests."""
        if bits is None:
            sampled = [(req, self.engine.sample(req.sampler, idx)) for req, idx in samples]
        else:
            sampled = self._sample_constrained(samples, bits)
        annotate(self.engine, samples, sampled)  # the logprobs asked (logprobs.py)
        pieces = [(req, tok, b"" if tok < 0 or self.engine.is_eog(tok) else self.engine.piece(tok))
                  for req, tok in sampled]
        now = time.monotonic_ns()
        with self.lock:
            for req, n in advances:
                req.n_past += n
                if req.phase is Phase.PREPARING:
                    self.stats.prompt_tokens_in += n
            for req, tok, piece in pieces:
                self._accept(req, tok, piece, now)
            self.tick += 1  # here, not in a lock of its own: one acquisition a step
            self.steps_with_tokens += 1
            self.tokens_decoded += len(entries)
        return len(sampled)

    def _sample_constrained(self, samples: list[tuple[Request, int]],
                            bits: Any) -> list[tuple[Request, int]]:
        """Sample with each constrained request's bitmask (row k for its k-th matcher, as
        started), and advance its matcher past the token.  A matcher in error (it ran
        past a step limit; its mask allows nothing) gives token -1: the request fails."""
        out: list[tuple[Request, int]] = []
        k = 0
        for req, idx in samples:
            m = req.matcher
            if m is None:
                out.append((req, self.engine.sample(req.sampler, idx)))
                continue
            row = bits[k]
            k += 1
            if m.error:
                out.append((req, -1))
                continue
            tok = self.engine.sample(req.sampler, idx, row)
            if not self.engine.is_eog(tok) and not m.consume(tok):
                tok = -1
            out.append((req, tok))
        return out

    def _accept(self, req: Request, token: int, piece: bytes, now: int) -> None:
        if req.phase.terminal:
            return
        eog = token >= 0 and self.engine.is_eog(token)
        ending = accept(req, token, piece, now, self.stats, eog=eog, held=req.n_past + 1,
                        context=self.engine.slot_context)
        if ending is None:
            req.next_token = token
        else:
            self.active.remove(req)
            self._finish(req, *ending)

    def run(self) -> None:
        """The engine thread: step while there is work, sleep on the condition otherwise."""
        while True:
            with self.lock:
                while not self._stopping and not self.queue and not self.active and not (
                        self.side and self.side.pending()):
                    self.cond.wait()
                if self._stopping:
                    break
                side = self.side if self.side and self.side.pending() else None
            self.step()
            if side is not None:
                side.step(bool(self.active or self.queue))
        self.masks.close()  # here, on the engine thread: no step is using it

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self.cond.notify_all()
