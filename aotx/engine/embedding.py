"""Embeddings: a second llama.cpp context on a loaded model, and the engine thread's queue
of embedding jobs.

:class:`Embedder` is a context of its own on the model the generation engine already
loaded (the weights are shared, not loaded twice), created with ``embeddings`` on and a
pooling type: the generation context's KV streams and sequences are never touched, so an
embedding batch cannot evict a cached prompt or take a slot.  Its KV cache holds exactly
one decode (``context`` tokens, one unified buffer) and is cleared before each one: an
input is embedded in a single ``llama_decode``, which pooling over a whole sequence (and
a non-causal encoder) needs.

:class:`EmbedQueue` runs on the model's engine thread, between decode steps
(``Scheduler.side``): each :meth:`EmbedQueue.step` is one decode, packing whole inputs of
the queued jobs (several requests' inputs in one decode, each its own sequence id): the
whole context when nothing is generated, else :data:`BUSY_TOKENS` and at most
:data:`BUSY_SHARE` of the thread's time, so a stream keeps about half its pace and waits
one short decode at most.

The queue is shared between principals as the slots are (engine/fair.py): a FIFO per
principal, and each input of a decode goes to the principal with the fewest tokens in
that decode so far, the one served least recently breaking ties (max-min fairness on
the decode's tokens).  So a principal's call waits for the decode in flight and is in
the next one, however much another principal has queued; within a principal, inputs
keep their order.  A job can be withdrawn at any time (:meth:`EmbedQueue.withdraw`, its
caller gone): it is answered at once and its inputs are not embedded.  An embedder thread of its own would instead
compete with the generation thread pool for the same cores, where ggml's spinning
workers slow both down (docs/architecture.md, "Embeddings", has the figures).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import llama_cpp
import numpy as np

from .llama import EngineError, LlamaEngine, _ggml_libs

log = logging.getLogger("aotx.engine")

#: Pooling names (the models file's and the capabilities') -> llama.cpp's pooling types.
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
#: Inputs one decode may hold (each is a sequence of the embedding context).
MAX_SEQS = 64
#: Tokens of one decode while requests are being generated (an input longer than this
#: still goes whole, alone): a stream then waits a short decode, not a full one.
BUSY_TOKENS = 64
#: The share of the engine thread's time embeddings take while requests are being
#: generated: after a decode of t seconds, the next waits t seconds of decode steps.
BUSY_SHARE = 0.5

Vectors = np.ndarray[Any, np.dtype[np.float32]]


class Embedder:
    """An embedding context on ``engine``'s model: ``context`` tokens per decode (and so per
    input), ``pooling`` a name of :data:`POOLING`, or None for the pooling the GGUF file
    declares (mean when it declares none)."""

    def __init__(self, engine: LlamaEngine, context: int, pooling: str | None = "mean") -> None:
        if llama_cpp.llama_model_has_encoder(engine.model):  # T5: llama_encode, not here
            raise EngineError("encoder-decoder models are not supported for embeddings")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = context
        params.n_seq_max = MAX_SEQS
        params.n_threads = params.n_threads_batch = engine.threads
        params.embeddings = True
        params.kv_unified = True  # one decode's inputs share the cells; any length fits
        params.pooling_type = (llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if pooling is None
                               else POOLING[pooling])
        params.no_perf = True
        # Flash attention off: with it on, llama.cpp's CPU kernel gave an input's vector
        # 8e-3 apart (cosine 0.9995) beside other inputs; without, 2e-3 (cosine 0.99998).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not create an embedding context of {context}")
        kind = int(llama_cpp.llama_pooling_type(self.ctx))
        if kind == llama_cpp.LLAMA_POOLING_TYPE_NONE:  # the GGUF names none: mean
            llama_cpp.llama_free(self.ctx)
            params.pooling_type = POOLING["mean"]
            self.ctx = llama_cpp.llama_init_from_model(engine.model, params)
            kind = int(llama_cpp.llama_pooling_type(self.ctx))
        names = {v: k for k, v in POOLING.items()}
        if kind not in names:  # RANK: a reranker's score, not an embedding
            llama_cpp.llama_free(self.ctx)
            raise EngineError(f"pooling type {kind} does not give embeddings")
        self.pooling = names[kind]
        if engine.threadpool:  # the engine thread's pool: both contexts run on that thread
            lib = llama_cpp.llama_cpp._lib
            _ggml_libs()
            lib.llama_attach_threadpool(ctypes.c_void_p(self.ctx),
                                        ctypes.c_void_p(engine.threadpool),
                                        ctypes.c_void_p(engine.threadpool))
        self.context = context
        self.dims = int(llama_cpp.llama_model_n_embd(engine.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)  # None for an encoder without KV
        self.batch = llama_cpp.llama_batch_init(context, 0, 1)

    def embed(self, inputs: list[list[int]]) -> Vectors:
        """Unit vectors of ``inputs`` (at most :data:`MAX_SEQS`, ``context`` tokens in all),
        one decode.  Raises EngineError when the decode fails."""
        b, n = self.batch, 0
        if len(inputs) > MAX_SEQS or sum(map(len, inputs)) > self.context:
            raise EngineError("embedding batch overflow")
        for seq, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = token, pos, 1
                b.seq_id[n][0], b.logits[n] = seq, True
                n += 1
        b.n_tokens = n
        if self.memory:
            llama_cpp.llama_memory_clear(self.memory, True)
        status = int(llama_cpp.llama_decode(self.ctx, b))
        if status != 0:
            raise EngineError(f"llama_decode returned {status}")
        out = np.empty((len(inputs), self.dims), dtype=np.float32)
        for seq in range(len(inputs)):
            row = llama_cpp.llama_get_embeddings_seq(self.ctx, seq)
            if not row:
                raise EngineError(f"no embedding for sequence {seq}")
            out[seq] = np.ctypeslib.as_array(row, shape=(self.dims,))
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out /= np.where(norms > 0, norms, np.float32(1.0))  # unit length, as OpenAI's
        return out

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


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


class EmbedQueue:
    """The jobs of one model's embedder, run on its engine thread (Scheduler.side)."""

    def __init__(self, embedder: Embedder, lock: threading.Lock, wake: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.embedder = embedder
        self.clock = clock
        self.resume_at = 0.0  # while busy, no decode before (BUSY_SHARE)
        self.lock = lock
        self.wake = wake  # notifies the engine thread (lock held)
        self.fifos: dict[int, deque[EmbedJob]] = {}  # principal -> its jobs, in order
        self._served = 0  # decodes planned so far
        self._last: dict[int, int] = {}  # principal -> the decode that last served it
        self.decodes = 0
        self.inputs = 0
        self.tokens = 0
        self.withdrawn = 0

    def submit(self, job: EmbedJob) -> None:
        """Queue ``job`` (lock held)."""
        job.vectors = np.empty((len(job.inputs), self.embedder.dims), dtype=np.float32)
        self.fifos.setdefault(job.principal, deque()).append(job)
        self.wake()

    def withdraw(self, job: EmbedJob) -> None:
        """Answer ``job`` now, without its vectors (lock held): its caller is gone.  A
        decode in flight that holds some of its inputs drops their vectors."""
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

    def queued(self, principal: int) -> int:
        """The principal's jobs in the queue (lock held)."""
        return len(self.fifos.get(principal, ()))

    def _plan(self, room: int) -> list[tuple[EmbedJob, int, int]]:
        """(job, first input, end) spans for one decode (lock held): whole inputs while
        they fit ``room`` tokens (the first one: the context) and the sequence count, each
        to the principal with the fewest tokens planned so far (max-min), then the one
        served least recently; a principal's inputs in order, none skipped."""
        ends = {job: job.next for fifo in self.fifos.values() for job in fifo}
        heads = {p: 0 for p in self.fifos}  # principal -> index of its job being planned
        planned = {p: 0 for p in self.fifos}
        seqs, first = MAX_SEQS, self.embedder.context
        while seqs and heads:
            p = min(heads, key=lambda k: (planned[k], self._last.get(k, -1)))
            job = self.fifos[p][heads[p]]
            size = len(job.inputs[ends[job]])
            if size > max(room, first):
                del heads[p]  # its next input opens a later decode
                continue
            first, room, seqs = 0, room - size, seqs - 1
            planned[p] += size
            ends[job] += 1
            if ends[job] == len(job.inputs):
                heads[p] += 1
                if heads[p] == len(self.fifos[p]):
                    del heads[p]
        self._served += 1
        for p, n in planned.items():
            if n:
                self._last[p] = self._served
        return [(job, job.next, end) for job, end in ends.items() if end > job.next]

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

    def _decode(self, busy: bool) -> None:
        with self.lock:
            spans = self._plan(min(BUSY_TOKENS, self.embedder.context) if busy
                               else self.embedder.context)
            if not spans and self.fifos:  # an input longer than the context (the device
                job = next(iter(self.fifos.values()))[0]  # refuses those): fail it, never
                spans, job.error = [(job, job.next, job.next)], "input longer than the context"
        inputs = [t for job, a, b in spans for t in job.inputs[a:b]]
        vectors: Vectors | None
        try:
            vectors, error = (self.embedder.embed(inputs), "") if inputs else (None, "")
        except EngineError as exc:
            vectors, error = np.empty((0, 0), np.float32), str(exc)
            log.error("event=embed.failed inputs=%d error=%s", len(inputs), error)
        with self.lock:
            at = 0
            for job, a, b in spans:
                if error:
                    job.error = error
                elif vectors is not None:
                    job.vectors[a:b] = vectors[at:at + b - a]
                    at += b - a
                job.next = b
                if job.error or job.next == len(job.inputs):
                    self._drop(job)
                    job.finish()  # (nothing for a job withdrawn meanwhile: answered)
            self.decodes += 1
            self.inputs += len(inputs)
            self.tokens += sum(map(len, inputs))
