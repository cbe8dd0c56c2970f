"""What a scheduler step holds: requests started from the fair queue while sequences,
prompt turns and KV room allow, cancelled and yielding work ended, and the batch
chosen: a token for each running sequence (a constrained one when its masks have their
turn), a prompt chunk of one being prepared, or one media segment alone.

A mixin of :class:`~aotx.engine.llama.scheduler.Scheduler`, on its state under the
device lock.
"""

from __future__ import annotations

import collections

from ...wire import Finish, Phase
from ..fair import owner_of
from ..grammar import MaskFiller
from ..interface import BatchEntry
from ..multimodal import MediaSegment
from ..request import Failure, Request
from .cache import COPY_MIN_TOKENS, SequenceCache
from .chunking import ChunkCost, widen_final

#: Prompt tokens per step for background (policy) work, so that a foreground
#: request arriving meanwhile waits for at most one short step.
BACKGROUND_CHUNK = 16


class StepPlan(SequenceCache):
    # the scheduler's state this part reads and writes (Scheduler.__init__ sets it)
    prompts_per_step: int
    apart_rows: int
    chunk_cost: ChunkCost | None
    masks: MaskFiller
    _prompt_turn: bool

    def _finish(self, req: Request, phase: Phase, finish: Finish = Finish.NONE,
                failure: Failure = Failure.NONE) -> None:
        raise NotImplementedError  # the scheduler's (scheduler.py)

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
