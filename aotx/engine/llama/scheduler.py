"""Continuous batching over one engine.

Each call to :meth:`Scheduler.step` is one ``llama_decode``: one token for every
running sequence and prompt chunks of sequences being prepared (or the two in turns).
Requests join between steps (when a sequence, a KV stream, is free) and leave between
steps; cancellation is a flag on the request, never touching the sequence's next user.

Locking: the device lock guards every request field the control thread reads, held
while a step is planned and its results applied, never during ``llama_decode``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from ...wire import EngineFeature, Finish, Phase, Sampling
from ..accept import accept
from ..fair import NOBODY, FairQueue, owner_of, usable_prefix
from ..grammar import MaskFiller
from ..interface import BatchEntry, Engine, EngineError, EngineStats, Side, StepOutcome
from ..logprobs import Annotations, annotate
from ..multimodal import MediaInputError, MediaSegment, release_all
from ..output import OutputBuffer
from ..request import Failure, Request, settle
from .chunking import ChunkCost, widen_final
from .kvpool import KvPool
from .spill import SpillStore

__all__ = ["Failure", "OutputBuffer", "Request", "Scheduler", "StepOutcome"]


#: Prompt tokens per step for background (policy) work, so that a foreground
#: request arriving meanwhile waits for at most one short step.
BACKGROUND_CHUNK = 16
#: A running sequence's prefix is copied into a new request's sequence when it
#: saves at least this many prompt tokens over the best free sequence's cache
#: (a stream copy costs milliseconds; evaluating 16 tokens costs more).
COPY_MIN_TOKENS = 16
#: Choosing a sequence, each cached token it would discard counts this much less than a
#: token it lets the request reuse; with a spill store the discarded tokens are saved,
#: not lost, and saving costs ~1/50 of evaluating a token here (19-60 ms against 2.7 s
#: for 1000), so they count far less.
DISCARD_WEIGHT = 4
DISCARD_WEIGHT_SPILLED = 64


SamplerFactory = Callable[[Request], object]


class Scheduler:
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
                "prefix_cache_hits": self.reused_tokens}

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

    def _plan(self) -> tuple[list[BatchEntry], list[tuple[Request, int]],
                             list[tuple[Request, int]], tuple[Request, MediaSegment] | None]:
        """Choose this step's tokens, and at most one media segment.  Lock held."""
        self._drop_cancelled()
        if self.queue and self.free_seqs:
            running = collections.Counter(owner_of(r) for r in self.active)
            later: list[Request] = []
            preparing = sum(1 for r in self.active if r.phase is Phase.PREPARING)
            while self.queue and self.free_seqs:
                if self.prompts_per_step and preparing >= self.prompts_per_step:
                    break
                req = self.queue.pop_next(running)
                if self._twin_preparing(req):
                    later.append(req)
                    continue
                if not self._room(req):
                    later.append(req)  # it waits for cells (kvpool.py)
                    break
                running[owner_of(req)] += 1
                preparing += 1
                self._start(req)
            for req in reversed(later):
                self.queue.push_front(req)
        return self._choose()

    def _twin_preparing(self, req: Request) -> bool:
        """Is a request of the same principal with the same prompt still evaluating it?
        Then ``req`` waits for it and copies its cells (``n`` choices, or a client that
        sends one prompt several times at once evaluate the prompt once, not n times).
        Not for media prompts: their placeholder tokens are the same for other images."""
        if req.segments or len(req.prompt) <= COPY_MIN_TOKENS:  # not worth a copy
            return False
        who = owner_of(req)
        return any(o.phase is Phase.PREPARING and o.n_past < len(o.prompt) - 1
                   and owner_of(o) == who and not o.segments
                   and len(o.prompt) == len(req.prompt) and o.prompt == req.prompt
                   for o in self.active)

    def _drop_cancelled(self) -> None:
        """End cancelled requests; background work yields when foreground work waits."""
        for req in [r for r in self.queue if r.cancel_requested]:
            self.queue.remove(req)
            self._finish(req, Phase.CANCELLED)
        for req in [r for r in self.active if r.cancel_requested]:
            self.active.remove(req)
            self._finish(req, Phase.CANCELLED)
        if any(not r.background for r in self.queue):
            # Foreground work is waiting: background (policy) work yields at this step.
            for req in [r for r in [*self.queue, *self.active] if r.background]:
                if req in self.queue:
                    self.queue.remove(req)
                else:
                    self.active.remove(req)
                req.preempted = True
                self._finish(req, Phase.CANCELLED)

    def _start(self, req: Request) -> None:
        """Give a queued request a sequence, with as much of its prompt cached as it may
        reuse (its principal's own cells, or the public prefix: fair.usable_prefix).  A
        preempted request evaluates its generated tokens too, and keeps its sampler."""
        req.prefill = req.prompt + req.generated
        who = owner_of(req)
        seq, have = self._best_sequence(req, who)
        self.free_seqs.remove(seq)
        keep = min(have, len(req.prefill) - 1)
        self._spill(seq, keep)
        if not self.engine.trim_sequence(seq, keep):
            # The memory cannot be cut back to ``keep`` (a recurrent model):
            # start the sequence empty and evaluate the whole prompt.
            self.engine.clear_sequence(seq)
            keep = 0
        self.cached[seq] = req.prefill[:keep]
        self.owner[seq] = who
        req.seq = seq
        req.n_past = keep
        if not req.preemptions:  # (what the client is told was cached: the first start)
            req.reused_tokens = keep
        self.reused_tokens += keep
        self.prompt_tokens_looked_up += len(req.prefill)
        req.phase = Phase.PREPARING
        if req.sampler is None:  # (a preempted request keeps its own)
            req.sampler = self.make_sampler(req)
            req.buffer = OutputBuffer(req.stops)
            req.notes = (Annotations(req.sampling.logprobs - 1) if req.sampling.logprobs
                         else None)
        self.active.append(req)

    def _best_sequence(self, req: Request, who: int) -> tuple[int, int]:
        """The free sequence for ``req`` and the tokens of its prefill it holds."""
        seq, have = self._cached_sequence(req, who)
        # A sequence in use may hold a longer prefix (requests arriving together
        # share the chat template's system prompt): copy it into the lowest free
        # sequence instead of evaluating it again.
        source, shared = None, 0
        for other in self.active:
            n = min(usable_prefix(other.prefill, owner_of(other), req.prefill, who,
                                  self.public), other.n_past)
            if n > shared:
                source, shared = other, n
        key, saved = self.spill.best(req.prefill, who, self.public) if self.spill.entries \
            else (0, 0)
        if saved > shared and self.spill.worth_restoring(key, saved - have):
            # Its conversation went to host memory when another took its sequence.
            self._spill(seq, 0)
            entry = self.spill.take(key)
            restored = self.engine.restore_sequence(seq, entry.data)
            self.spill.restores += restored
            self.cached[seq] = entry.tokens if restored else []
            self.owner[seq] = entry.owner
            return seq, saved if restored else 0
        if source is not None and shared - have >= COPY_MIN_TOKENS:
            seq = min(self.free_seqs)
            self._spill(seq, 0)
            self.engine.copy_sequence(source.seq, seq)
            self.cached[seq] = source.prefill[:shared]
            have = shared
            self.copies += 1
        return seq, have

    def _spill(self, seq: int, keep: int) -> None:
        """Save the free sequence's cells to host memory first, when taking it would
        discard enough of them (tokens past ``keep``) to be worth a later restore."""
        held = self.cached.get(seq, [])
        if self.spill.worth(len(held) - keep):
            self.spill.put(held, self.owner.get(seq, NOBODY), self.engine.save_sequence(seq))

    def _cached_sequence(self, req: Request, who: int) -> tuple[int, int]:
        """The free sequence whose cached tokens ``req`` reuses best, and how many."""
        # The free sequence whose cached tokens share the longest usable prefix with
        # this prompt; at least the prompt's last token is evaluated again,
        # since its logits are needed for the first sample.
        # Prefer the longest cached prefix, less a quarter of the cached tokens it would
        # throw away (another principal's 600 private tokens are worth keeping for it
        # more than 20 public ones are worth reusing; a 64th when they are spilled,
        # since its owner gets them back), then the lowest sequence id: streams in use
        # stay a compact range, which llama.cpp batches fastest.
        held = {q: usable_prefix(self.cached.get(q, []), self.owner.get(q, NOBODY),
                                 req.prompt + req.generated, who, self.public)
                for q in self.free_seqs}
        weight = DISCARD_WEIGHT_SPILLED if self.spill.budget else DISCARD_WEIGHT
        seq = max(self.free_seqs, key=lambda q: (
            held[q] * weight - (len(self.cached.get(q, ())) - held[q]), -q))
        return seq, held[seq]

    def _room(self, req: Request) -> bool:
        """Whether ``req`` may start now: its prompt fits the KV pool beside the running
        sequences, once the least recently used cached prefixes are given back if need
        be.  Alone, a request always starts (its context fits the pool)."""
        if not self.active or not self.pool.shared:
            return True
        if self.pool.ended < req.resume_after:
            return False  # preempted: it waits until a request ends, else it would thrash
        seq, have = self._cached_sequence(req, owner_of(req))
        need = len(req.prompt) + len(req.generated) - have
        used = self.pool.in_use(self.active, self.cached, self.free_seqs)
        if self.pool.room(need, len(self.active), used):
            return True
        # Give back least recently used cached prefixes (not the one it reuses), only if
        # that makes room.
        evictable = [q for q in self.pool.evictable(self.cached, self.free_seqs) if q != seq]
        gone = 0
        for n, q in enumerate(evictable):
            gone += len(self.cached[q])
            if self.pool.room(need, len(self.active), used - gone):
                for r in evictable[:n + 1]:
                    self._evict(r)
                return True
        return False

    def _evict(self, seq: int) -> None:
        self._spill(seq, 0)
        self.engine.clear_sequence(seq)
        self.cached[seq] = []
        self.pool.evictions += 1

    def _relieve(self) -> bool:
        """After a decode that found no KV cells: give back the cached prefixes, or else
        preempt a request (kvpool.py).  False when there is nothing to give back."""
        cached = self.pool.evictable(self.cached, self.free_seqs)
        for q in cached:
            self._evict(q)
        if cached:
            return True
        req = self.pool.victim(self.active)
        if req is None:
            return False
        self.active.remove(req)
        self.engine.clear_sequence(req.seq)
        self.cached[req.seq] = []
        self.free_seqs.append(req.seq)
        req.seq = -1
        req.n_past = 0
        req.phase = Phase.PREPARING  # it evaluates its context again when it starts
        req.preemptions += 1
        req.resume_after = self.pool.ended + 1
        self.pool.preemptions += 1
        self.queue.push_front(req)
        return True

    def _choose(self) -> tuple[list[BatchEntry], list[tuple[Request, int]],
                               list[tuple[Request, int]], tuple[Request, MediaSegment] | None]:
        """The step's batch entries, samples and advances, and at most one media segment."""
        # A running sequence's token (a constrained one when its principal's masks have
        # their turn beside others' plain rows: grammar.py), a prompt chunk of one being
        # prepared; with ``apart_rows`` a step holds one kind or the other, in turns (a
        # prompt's rows beside other streams compute otherwise).  Media: alone, first.
        chosen: list[tuple[Request, list[BatchEntry], bool]] = []
        media: tuple[Request, MediaSegment] | None = None
        running = sum(1 for r in self.active if r.phase is Phase.RUNNING)
        prompts = not running or not self.apart_rows or (self._prompt_turn and any(
            r.phase is Phase.PREPARING for r in self.active))
        decode = not (self.apart_rows and prompts)
        self._prompt_turn = not prompts
        budget = (self.batch - running * decode) if prompts else 0
        plain = {owner_of(r) for r in self.active if r.matcher is None and not r.background}
        for req in self.active:
            seg = (req.segments[req.next_segment] if req.next_segment < len(req.segments)
                   else None)
            if req.phase is Phase.RUNNING:
                if decode and self.masks.turn(req.matcher, owner_of(req),
                                              bool(plain - {owner_of(req)})):
                    chosen.append((req, [BatchEntry(req.next_token, req.n_past, req.seq, True)],
                                   True))
            elif seg is not None and seg.start == req.n_past:
                if media is None:
                    media = (req, seg)
            elif budget > 0:
                end = seg.start if seg is not None else len(req.prefill)
                take = min(budget, end - req.n_past)
                if req.background:  # small steps: foreground work waits at most one of them
                    take = min(take, BACKGROUND_CHUNK)
                cost = None if req.background else self.chunk_cost  # (no 65-row chunks)
                if take == end - req.n_past and (cost or self.apart_rows):
                    take += widen_final(self.engine, req, take, budget, cost, self.apart_rows)
                last = req.n_past + take == len(req.prefill)
                chosen.append((req, [BatchEntry(req.prefill[p], p, req.seq,
                                                last and p == req.n_past + take - 1)
                                     for p in range(req.n_past, req.n_past + take)], last))
                # apart: one prompt a step (llama.cpp would split two into equal rows)
                budget = 0 if self.apart_rows else budget - take
        # llama.cpp computes a multi-stream batch fastest when its sequences (KV
        # streams) come in ascending order: a reversed or shuffled order measured
        # at half the throughput.  Order the batch by sequence id.
        chosen.sort(key=lambda c: c[0].seq)
        entries: list[BatchEntry] = []
        samples: list[tuple[Request, int]] = []
        advances: list[tuple[Request, int]] = []
        for req, toks, sample in chosen:
            entries += toks
            advances.append((req, len(toks)))
            if sample:
                samples.append((req, len(entries) - 1))
        return entries, samples, advances, media

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

    def warm(self, prefix: list[int]) -> None:
        """Evaluate ``prefix`` (the chat template's fixed start) into sequence 0 before
        serving, so that the first requests, and every request copied from them,
        start with it in cache.  Called before the engine thread starts."""
        self.public = list(prefix)  # the same for everybody, cached or not
        if not prefix or not self.free_seqs:
            return
        for start in range(0, len(prefix), self.batch):
            part = prefix[start:start + self.batch]
            status = self.engine.decode([BatchEntry(t, start + i, 0, False)
                                         for i, t in enumerate(part)])
            if status != 0:
                self.engine.clear_sequence(0)
                return
        self.cached[0] = list(prefix)
        self.owner[0] = NOBODY

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
