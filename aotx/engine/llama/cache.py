"""The scheduler's prefix cache and KV cells: which free sequence a request starts in
(the longest prefix it may reuse: its principal's own cells or the public template
start, fair.usable_prefix), copies from a sequence in use, spills to and restores from
host memory (spill.py), room in a shared pool and what gives it back (kvpool.py), and
the template's start evaluated before serving (``warm``).

A mixin of :class:`~aotx.engine.llama.scheduler.Scheduler`: it works on the scheduler's
state, declared below, under the device lock (``warm``: before the engine thread runs).
"""

from __future__ import annotations

from collections.abc import Callable

from ...wire import Phase
from ..fair import NOBODY, FairQueue, owner_of, usable_prefix
from ..interface import BatchEntry, Engine
from ..logprobs import Annotations
from ..output import OutputBuffer
from ..request import Request
from .kvpool import KvPool
from .spill import SpillStore

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


class SequenceCache:
    # the scheduler's state this part reads and writes (Scheduler.__init__ sets it)
    engine: Engine
    batch: int
    queue: FairQueue[Request]
    active: list[Request]
    free_seqs: list[int]
    cached: dict[int, list[int]]  # seq -> tokens held in its KV cells
    owner: dict[int, int]  # seq -> whose request computed them (fair.owner_of)
    public: list[int]  # the template's fixed start: anybody may reuse it
    pool: KvPool
    spill: SpillStore
    make_sampler: Callable[[Request], object]
    copies: int
    reused_tokens: int
    prompt_tokens_looked_up: int

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
