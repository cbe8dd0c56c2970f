"""Embeddings: the engine thread's queue of embedding jobs, whichever embedder decodes
them (llama.cpp's: engine/llama/embedder.py and embed_pieces.py).

:class:`EmbedQueue` runs on the model's engine thread, between decode steps
(``Scheduler.side``): each :meth:`EmbedQueue.step` is one decode, packing whole inputs of
the queued jobs (several requests' inputs in one decode, each its own sequence id): the
whole context when nothing is generated, else :data:`BUSY_TOKENS` and at most
:data:`BUSY_SHARE` of the thread's time, so a stream keeps about half its pace and waits
one short decode at most.

The queue is shared between principals as the slots are (engine/fair.py): a FIFO per
principal, and each input of a decode goes to the principal with the fewest tokens in
that decode so far, the one served the fewest tokens lately breaking ties (max-min
fairness on the decode's tokens, least attained service between decodes).  So a
principal's call waits for the decode in flight and is in the next one, however much
another principal has queued; within a principal, inputs keep their order.  A chat
model's inputs go in pieces (engine/embed_pieces.py), and while several principals use
the queue its decodes are of :data:`SHARED_TOKENS`: what one principal sends never
makes another's call wait for more than a short decode.  A job can be withdrawn at any time (:meth:`EmbedQueue.withdraw`, its
caller gone): it is answered at once and its inputs are not embedded.  An embedder thread of its own would instead
compete with the generation thread pool for the same cores, where ggml's spinning
workers slow both down (docs/engine.md, "Embeddings", has the figures).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .interface import EngineError

log = logging.getLogger("aotx.engine")

#: Inputs one decode may hold (each is a sequence of the embedding context).
MAX_SEQS = 64
#: Tokens of one decode while requests are being generated (an input longer than this
#: still goes whole, alone): a stream then waits a short decode, not a full one.
BUSY_TOKENS = 64
#: The share of the engine thread's time embeddings take while requests are being
#: generated: after a decode of t seconds, the next waits t seconds of decode steps.
BUSY_SHARE = 0.5
#: Tokens of one decode of an embedder that takes inputs in pieces (engine/
#: embed_pieces.py), while one principal alone has had calls queued lately: 93 % of a
#: whole 512-token decode's throughput on SmolLM2-135M, at 350 ms a decode.
PIECE_TOKENS = 64
#: ... and while several have (within ``SHARED_WINDOW`` seconds): another principal's
#: call then waits at most a 2-token decode (17 ms there), at 62 % of the throughput
#: (4 tokens: 23-28 ms at 71-89 %).  Issue 39's flood: the other principal's calls
#: answer in 39 ms (p50), 55 ms (p95) against 28 ms unloaded; 4 tokens gave 55, 84 ms.
SHARED_TOKENS = 2
SHARED_WINDOW = 10.0
#: Between decodes, the principal served the fewest tokens lately goes first (least
#: attained service): a light caller's input is not made to alternate with a heavy one's.
USAGE_HALF_LIFE = 2.0

Vectors = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(eq=False)
class EmbedJob:
    """One EMBED call's inputs (tokens), filled in order; ``done`` is called once, on the
    engine thread or (withdrawn) the control thread, with the lock held, once every input
    is embedded, a decode failed, or the job was withdrawn."""

    inputs: list[list[int]]
    done: Callable[[EmbedJob], None]
    principal: int = 0  # whose call: the queue's FIFO
    vectors: Vectors = field(default_factory=lambda: np.empty((0, 0), np.float32))
    next: int = 0  # the first input not embedded yet
    error: str = ""  # why the job failed (a decode failed), else ""
    withdrawn: bool = False  # its caller is gone: answered without its vectors
    answered: bool = False
    tokens: int = 0

    def __post_init__(self) -> None:
        self.tokens = sum(map(len, self.inputs))

    def finish(self) -> None:
        """Answer the job, once (lock held)."""
        if not self.answered:
            self.answered = True
            self.done(self)


class EmbedderInfo(Protocol):
    dims: int  # floats per vector
    context: int  # the most tokens of one input
    pooling: str

    def close(self) -> None: ...


class Embeddings(Protocol):
    """What the device needs of a model's embeddings: :class:`EmbedQueue` on llama.cpp,
    ``VllmEmbeddings`` on vLLM (engine/vllm_inputs.py)."""

    @property
    def embedder(self) -> EmbedderInfo: ...
    def submit(self, job: EmbedJob) -> None: ...
    def withdraw(self, job: EmbedJob) -> None: ...


@dataclass(eq=False)
class _Piece:
    """Tokens ``start:end`` of input ``index`` of ``job``, under sequence ``seq``."""

    job: EmbedJob
    index: int
    start: int
    end: int
    seq: int

    @property
    def last(self) -> bool:
        return self.end == len(self.job.inputs[self.index])


class EmbedQueue:
    """The jobs of one model's embedder, run on its engine thread (Scheduler.side).

    An embedder with ``chunked`` (engine/embed_pieces.py) takes inputs in pieces: each
    principal has at most one input in progress (``partial``), its KV cells reserved whole
    when its first piece is planned."""

    def __init__(self, embedder: Any, lock: threading.Lock, wake: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.embedder = embedder
        self.chunked = bool(getattr(embedder, "chunked", False))
        self.clock = clock
        self.resume_at = 0.0  # while busy, no decode before (BUSY_SHARE)
        self.lock = lock
        self.wake = wake  # notifies the engine thread (lock held)
        self.fifos: dict[int, deque[EmbedJob]] = {}  # principal -> its jobs, in order
        self.partial: dict[int, _Piece] = {}  # principal -> its input in progress (chunked)
        self.reserved: dict[int, int] = {}  # principal -> KV cells its inputs reserve
        self.seen: dict[int, float] = {}  # principal -> when it last had a call queued
        self._served = 0  # decodes planned so far
        self._last: dict[int, int] = {}  # principal -> the decode that last served it
        self.usage: dict[int, float] = {}  # principal -> tokens served lately (decaying)
        self._decayed = clock()
        self.decodes = 0
        self.inputs = 0
        self.tokens = 0
        self.withdrawn = 0

    def submit(self, job: EmbedJob) -> None:
        """Queue ``job`` (lock held)."""
        job.vectors = np.empty((len(job.inputs), self.embedder.dims), dtype=np.float32)
        self.fifos.setdefault(job.principal, deque()).append(job)
        self.seen[job.principal] = self.clock()
        self.wake()

    def withdraw(self, job: EmbedJob) -> None:
        """Answer ``job`` now, without its vectors (lock held): its caller is gone.  A
        decode in flight that holds some of its inputs drops them; its input in progress
        is dropped by the engine thread (:meth:`_reap`)."""
        if job.answered:
            return
        job.withdrawn = True
        self._drop(job)
        self.withdrawn += 1
        job.finish()

    def _drop(self, job: EmbedJob) -> None:
        fifo = self.fifos.get(job.principal)
        if fifo is not None and job in fifo:
            fifo.remove(job)
            if not fifo:
                del self.fifos[job.principal]
                self._last.pop(job.principal, None)  # idle: starts afresh (bounded table)

    def pending(self) -> bool:
        return bool(self.fifos)

    def _room(self, busy: bool) -> int:
        """The most tokens of the next decode (lock held): at most :data:`BUSY_TOKENS`
        while requests are generated (``busy``)."""
        room = min(BUSY_TOKENS, self.embedder.context) if busy else self.embedder.context
        if not self.chunked:
            return room
        now = self.clock()
        for p in self.fifos:
            self.seen[p] = now
        self.seen = {p: t for p, t in self.seen.items() if now - t < SHARED_WINDOW}
        return min(SHARED_TOKENS if len(self.seen) > 1 else PIECE_TOKENS, room)

    def _next(self, p: int, after: _Piece | None) -> tuple[EmbedJob, int, int] | None:
        """(job, input, first token) of principal ``p``'s next piece: after ``after`` (a
        whole input planned for this decode), else its input in progress, else its first
        job's next input."""
        fifo = self.fifos[p]
        if after is None:
            part = self.partial.get(p)
            if part is not None:
                return part.job, part.index, part.end
            return fifo[0], fifo[0].next, 0
        if after.index + 1 < len(after.job.inputs):
            return after.job, after.index + 1, 0
        k = fifo.index(after.job) + 1
        return (fifo[k], fifo[k].next, 0) if k < len(fifo) else None

    def _plan(self, room: int) -> list[_Piece]:
        """The pieces of one decode (lock held): to the principal with the fewest tokens
        planned so far (max-min), then the one served least recently; a principal's inputs
        in order, none skipped.  Whole inputs while they fit ``room`` tokens (the first
        one: the context), or, chunked, pieces of ``room`` tokens in all."""
        pieces: list[_Piece] = []
        seqs = [s for s in range(MAX_SEQS - 1, -1, -1)
                if s not in {q.seq for q in self.partial.values()}]
        planned = {p: 0 for p in self.fifos}
        at: dict[int, tuple[EmbedJob, int, int] | None] = {p: self._next(p, None)
                                                            for p in self.fifos}
        first = 0 if self.chunked else self.embedder.context
        while room > 0:
            ready = [p for p, nxt in at.items() if nxt is not None]
            if not ready:
                break
            p = min(ready, key=lambda k: (planned[k], self.usage.get(k, 0.0),
                                          self._last.get(k, -1)))
            job, index, start = at[p]  # type: ignore[misc]
            size = len(job.inputs[index]) - start
            if not start and not seqs:  # (an input in progress keeps its sequence)
                at[p] = None
                continue
            if self.chunked:
                take = min(size, room)
                if start == 0 and not self._reserve(p, size):
                    at[p] = None  # no room in the KV cache: a later decode
                    continue
            elif size > max(room, first):
                at[p] = None  # its next input opens a later decode
                continue
            else:
                take = size
            seq = self.partial[p].seq if start else seqs.pop()
            piece = _Piece(job, index, start, start + take, seq)
            pieces.append(piece)
            first, room, planned[p] = 0, room - take, planned[p] + take
            at[p] = self._next(p, piece) if piece.last else None
        self._account(planned)
        return pieces

    def _account(self, planned: dict[int, int]) -> None:
        """Count a decode's tokens to its principals: who was served least lately goes
        first in the next one (the tokens halve every ``USAGE_HALF_LIFE`` seconds)."""
        now = self.clock()
        decay = 0.5 ** ((now - self._decayed) / USAGE_HALF_LIFE)
        self._decayed = now
        self._served += 1
        self.usage = {p: u * decay for p, u in self.usage.items() if u * decay >= 0.5}
        for p, n in planned.items():
            if n:
                self._last[p] = self._served
                self.usage[p] = self.usage.get(p, 0.0) + n

    def _reserve(self, p: int, cells: int) -> bool:
        """Reserve KV cells for an input of ``p`` (chunked): at most the context for one
        principal, at most the cache for all (see engine/embed_pieces.py)."""
        held = self.reserved.get(p, 0)
        if held + cells > self.embedder.context or sum(
                self.reserved.values()) + cells > self.embedder.cells:
            return False
        self.reserved[p] = held + cells
        return True

    def _release(self, piece: _Piece) -> None:
        """The input of ``piece`` is done with: its cells, and its place in progress."""
        p = piece.job.principal
        self.reserved[p] -= len(piece.job.inputs[piece.index])
        if not self.reserved[p]:
            del self.reserved[p]
        part = self.partial.get(p)
        if part is not None and (part.job, part.index) == (piece.job, piece.index):
            del self.partial[p]

    def step(self, busy: bool = False) -> None:
        """One decode over the queued jobs' next inputs; finished jobs are answered.  While
        requests are being decoded (``busy``) the decode is of :data:`BUSY_TOKENS` and
        waits its turn (:data:`BUSY_SHARE`), so that streams keep most of their pace."""
        start = self.clock()
        if busy and start < self.resume_at:
            return
        self._decode(busy)
        end = self.clock()
        self.resume_at = end + (end - start) * (1 - BUSY_SHARE) / BUSY_SHARE

    def _reap(self) -> None:
        """Drop the inputs in progress of withdrawn jobs (engine thread, lock held)."""
        for piece in [q for q in self.partial.values() if q.job.withdrawn]:
            self.embedder.drop(piece.seq)
            self._release(piece)

    def _decode(self, busy: bool) -> None:
        with self.lock:
            if self.chunked:
                self._reap()
            pieces = self._plan(self._room(busy))
            if not pieces and self.fifos and not self.chunked:
                # an input longer than the context (the device refuses those): fail it
                job = next(iter(self.fifos.values()))[0]
                job.error = "input longer than the context"
                self._drop(job)
                job.finish()
                return
        vectors, error = self._embed(pieces)
        with self.lock:
            if error:
                self._fail(pieces, error)
            for piece in pieces if not error else ():
                self._settle(piece, vectors)
            self.decodes += 1
            self.inputs += sum(1 for q in pieces if q.last)
            self.tokens += sum(q.end - q.start for q in pieces)

    def _embed(self, pieces: list[_Piece]) -> tuple[dict[int, Vectors], str]:
        """The vectors of the inputs ``pieces`` end, by sequence; or why the decode failed."""
        if not pieces:
            return {}, ""
        try:
            if self.chunked:
                return self.embedder.run([(q.seq, q.job.inputs[q.index][q.start:q.end],
                                           q.start, q.last) for q in pieces]), ""
            out = self.embedder.embed([q.job.inputs[q.index] for q in pieces])
            return {q.seq: out[k] for k, q in enumerate(pieces)}, ""
        except EngineError as exc:
            log.error("event=embed.failed pieces=%d error=%s", len(pieces), exc)
            return {}, str(exc)

    def _fail(self, pieces: list[_Piece], error: str) -> None:
        """A decode failed (lock held): its jobs fail, and, chunked, every job with an
        input in progress (the embedder dropped them all)."""
        jobs = [q.job for q in pieces]
        if self.chunked:
            jobs += [q.job for q in self.partial.values()]
            self.partial.clear()
            self.reserved.clear()
        for job in dict.fromkeys(jobs):
            job.error = error
            self._drop(job)
            job.finish()

    def _settle(self, piece: _Piece, vectors: dict[int, Vectors]) -> None:
        """After the decode (lock held): the piece's input done, or still in progress."""
        job = piece.job
        if piece.last:
            job.vectors[piece.index] = vectors[piece.seq]
            job.next = piece.index + 1
        elif not job.withdrawn:
            self.partial[job.principal] = piece  # (its cells stay reserved)
            return
        else:
            self.embedder.drop(piece.seq)
        if self.chunked:
            self._release(piece)
        if job.withdrawn or job.next == len(job.inputs):
            self._drop(job)
            job.finish()  # (nothing for a job withdrawn meanwhile: answered)
