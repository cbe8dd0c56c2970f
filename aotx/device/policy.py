"""The resident policy (operation 12): automatic memory, as one state machine.

Theory of operation
-------------------
Sources
    A completed text request of a principal whose grant enables memory, on a
    qualified model role, that did not opt out, appends the user's words to the
    *source log* (:meth:`Policy.record`).  The *source frontier* counts the log
    entries the policy has finished with.

Work when quiet
    On each of the device's ticks (:meth:`Policy.tick`) the policy collects a
    finished extraction, then, when nothing else holds it, hands the device the next
    source to extract.  The device runs the extraction as a *background* request,
    which any foreground admission preempts: the source is retried later.  Each line
    of the answer is a candidate fact (:func:`~aotx.device.memory.decide`); kept facts
    are saved as a new generation of the principal's lineage, or wait for review.

States
    Every change of ``state`` and ``reason`` goes through :data:`TRANSITIONS`, the
    one table of the machine: ``(state, event) -> (state, reason)``.  An event that
    has no row in the current state changes nothing (a paused policy ignores its
    work finishing, for instance).  ``SETTLE`` as a target state is RECORDING while
    decisions wait for review and QUIET otherwise; ``KEEP`` as a target reason keeps
    the reason, and a SETTLE keeps CAPACITY (the last save found the lineage full)
    until work starts again.  The device asks the policy to act
    (control, tick, record, decide, erase) and reads its status; it never assigns the
    policy's fields.

Status
    Exactly the seed's 160-byte status (:meth:`Policy.status`); no private text or
    evidence identifiers enter it.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Callable
from typing import Protocol

from .. import wire
from ..wire import Phase, PolicyAction, PolicyReason, PolicyState, Reason
from .errors import DeviceError
from .memory import MAX_FACTS, MODE_AUTOMATIC_MEMORY, Lineage, Pending, Source, decide

log = logging.getLogger("aotx.policy")


class Event(enum.IntEnum):  # an int hash: the table is looked up on every pass
    PAUSE = enum.auto()
    RESUME = enum.auto()
    STOP = enum.auto()
    FOREGROUND = enum.auto()  # a tick found foreground work: the policy waits
    START = enum.auto()  # an extraction starts
    SETTLE = enum.auto()  # nothing left to do, or an extraction finished (or was dropped)
    INTERRUPT = enum.auto()  # the extraction was preempted by foreground work
    DECIDED = enum.auto()  # the last pending decision was approved or rejected
    FULL = enum.auto()  # a save found the principal's lineage full


S, R, E = PolicyState, PolicyReason, Event
SETTLE = None  # target state: RECORDING while decisions wait, else QUIET
KEEP = None  # target reason: unchanged
_RUNNING = (S.QUIET, S.ACTIVE, S.RECORDING)

#: The state machine: (state, event) -> (next state, next reason).  OFF and ERROR have
#: no rows: a policy without a qualified model never leaves OFF.
TRANSITIONS: dict[tuple[PolicyState, Event], tuple[PolicyState | None, PolicyReason | None]] = {
    **{(s, E.PAUSE): (S.PAUSED, R.PAUSED) for s in (*_RUNNING, S.PAUSED)},
    **{(s, E.RESUME): (SETTLE, R.QUIET) for s in (S.PAUSED, S.STOPPED)},
    **{(s, E.STOP): (S.STOPPED, R.PAUSED) for s in (*_RUNNING, S.PAUSED, S.STOPPED)},
    (S.QUIET, E.FOREGROUND): (S.QUIET, R.FOREGROUND),
    (S.RECORDING, E.FOREGROUND): (S.QUIET, R.FOREGROUND),
    (S.QUIET, E.START): (S.ACTIVE, R.ACTIVE),
    (S.RECORDING, E.START): (S.ACTIVE, R.ACTIVE),
    **{(s, E.SETTLE): (SETTLE, R.QUIET) for s in _RUNNING},
    (S.ACTIVE, E.INTERRUPT): (S.QUIET, R.FOREGROUND),
    (S.RECORDING, E.DECIDED): (S.QUIET, KEEP),
    **{(s, E.FULL): (s, R.CAPACITY) for s in (*_RUNNING, S.PAUSED, S.STOPPED)},
}


class Work(Protocol):
    """The extraction request as the policy sees it (an engine request)."""

    phase: Phase
    preempted: bool
    out: bytearray


class Policy:
    """The policy's state, counters, source log and pending decisions."""

    def __init__(self, root: str, enabled: bool) -> None:
        self.root = root
        self.enabled = enabled
        self.state = S.QUIET if enabled else S.OFF
        self.reason = R.QUIET if enabled else R.DISABLED
        self.review = False
        self.control_revision = 1
        self.frontier = 0
        self.completed = self.interrupted = self.refused = self.decisions = 0
        self.saved_generation = self.written_bytes = self.result_bytes = 0
        self.max_ns = self.last_ns = 0
        self.result_status = 0
        self.log: list[Source] = []
        self.pending: list[Pending] = []
        self.next_pending = 1
        self.active: Work | None = None  # the running extraction
        self.active_started = 0
        # The principal of the running extraction's source erased its memory meanwhile:
        # its result is dropped, not saved.
        self.discard_active = False
        self._memory: dict[int, tuple[int, list[str]]] = {}  # principal -> latest generation

    def enable(self) -> None:
        """A model qualified for automatic memory was loaded on first use: the policy,
        off while no loaded model qualified, starts (and stays on for the epoch; the
        sources of a model unloaded since are dropped when their turn comes)."""
        if not self.enabled:
            self.enabled = True
            self.state, self.reason = S.QUIET, R.QUIET
            log.info("event=policy.enabled")

    # -- the machine -------------------------------------------------------------------
    def _on(self, event: Event) -> None:
        row = TRANSITIONS.get((self.state, event))
        if row is None:
            return
        state, reason = row
        self.state = state if state is not None else (S.RECORDING if self.pending else S.QUIET)
        if reason is not None and not (event is E.SETTLE and self.reason is R.CAPACITY):
            self.reason = reason

    @property
    def held(self) -> bool:
        """Paused or stopped: no work starts."""
        return self.state in (S.PAUSED, S.STOPPED)

    def status(self) -> wire.PolicyStatus:
        return wire.PolicyStatus(
            mode=MODE_AUTOMATIC_MEMORY, state=self.state, review_enabled=int(self.review),
            pending=len(self.pending), active_rows=int(self.active is not None),
            result_status=self.result_status, control_revision=self.control_revision,
            source_frontier=self.frontier, completed=self.completed,
            interrupted=self.interrupted, refused=self.refused, decision=self.decisions,
            saved_generation=self.saved_generation, max_ns=self.max_ns, last_ns=self.last_ns,
            written_bytes=self.written_bytes, result_bytes=self.result_bytes, reason=self.reason)

    def control(self, action: PolicyAction, expected: int) -> None:
        """Apply a control at the expected revision (409 when stale, or when off)."""
        if not self.enabled:
            raise DeviceError(409, Reason.POLICY_OFF, payload=wire.encode_policy_status(
                self.status()))
        if expected != self.control_revision:
            raise DeviceError(409, Reason.STALE_REVISION, self.control_revision,
                              payload=wire.encode_policy_status(self.status()))
        if action is PolicyAction.REVIEW_ON or action is PolicyAction.REVIEW_OFF:
            self.review = action is PolicyAction.REVIEW_ON
        else:
            self._on({PolicyAction.PAUSE: E.PAUSE, PolicyAction.RESUME: E.RESUME,
                      PolicyAction.STOP: E.STOP}[action])
        self.control_revision += 1
        log.info("event=policy.control action=%s revision=%d state=%s", action.name,
                 self.control_revision, self.state.name)

    # -- sources and work ----------------------------------------------------------------
    def record(self, source: Source) -> None:
        self.log.append(source)

    def tick(self, foreground_busy: Callable[[], bool]) -> Source | None:
        """Collect a finished extraction; return the next source to extract, if the
        policy should start one now (the device then calls :meth:`started`)."""
        if not self.enabled:
            return None
        if self.active is not None and self.active.phase.terminal:
            self._collect(self.active)
        if self.active is not None or self.held:
            return None
        if self.frontier >= len(self.log):
            self._on(E.SETTLE)
            return None
        if foreground_busy():
            self._on(E.FOREGROUND)
            return None
        return self.log[self.frontier]

    def started(self, work: Work) -> None:
        self.active = work
        self.active_started = time.monotonic_ns()
        self._on(E.START)

    def drop(self, why: str) -> None:
        """Skip the next source: its extraction prompt could not be made (a template that
        refuses it; the qualified profiles' template never does)."""
        log.warning("event=policy.source_dropped frontier=%d error=%s", self.frontier, why)
        self._finish_source()

    def _collect(self, work: Work) -> None:
        self.active = None
        self.last_ns = time.monotonic_ns() - self.active_started
        self.max_ns = max(self.max_ns, self.last_ns)
        if self.discard_active:  # its principal erased its memory meanwhile
            self.discard_active = False
            self._finish_source()
            log.info("event=policy.source_dropped frontier=%d", self.frontier)
        elif work.preempted or work.phase is not Phase.COMPLETED:
            self.interrupted += 1
            self._on(E.INTERRUPT)
            log.info("event=policy.interrupted frontier=%d", self.frontier)
        else:
            kept = self._extract(self.log[self.frontier], bytes(work.out))
            self.completed += 1
            self._finish_source()
            log.info("event=policy.source_done frontier=%d kept=%d pending=%d", self.frontier,
                     kept, len(self.pending))

    def _finish_source(self) -> None:
        self.log[self.frontier].text = ""  # processed: the text is not needed any more
        self.frontier += 1
        self._on(E.SETTLE)

    def _extract(self, source: Source, answer: bytes) -> int:
        """Decide the answer's lines; save or queue the kept facts; how many were kept."""
        self.result_bytes += len(answer)
        existing = self.memory_for(source.principal)
        kept: list[str] = []
        text = answer.decode("utf-8", errors="replace")
        for line in re.split(r"\n|(?<=[.!?])\s+(?=[A-Z-])", text):
            if not line.strip():
                continue
            fact = decide(line, existing + kept, source.text)
            self.decisions += 1
            if fact is not None:
                kept.append(fact)
        if kept and self.review:
            for fact in kept:
                self.pending.append(Pending(self.next_pending, source.principal, fact))
                self.next_pending += 1
        elif kept:
            self._save(source.principal, kept)
        return len(kept)

    # -- a principal's memory --------------------------------------------------------------
    def lineage(self, principal: int) -> Lineage:
        return Lineage(self.root, principal)

    def memory_for(self, principal: int) -> list[str]:
        """The principal's saved facts (cached until its next save or erase)."""
        cached = self._memory.get(principal)
        if cached is None:
            cached = self._memory[principal] = self.lineage(principal).latest()
        return cached[1]

    def _save(self, principal: int, new: list[str]) -> None:
        lin = self.lineage(principal)
        _, facts = lin.latest()
        merged = facts + [f for f in new if f not in facts]
        if len(merged) > MAX_FACTS:
            self.refused += 1
            self._on(E.FULL)  # the settle that follows keeps CAPACITY
            self.result_status = 507
            return
        gen, written = lin.save(merged)
        self._memory.pop(principal, None)
        self.saved_generation += 1
        self.written_bytes += written
        self.result_status = 200
        log.info("event=memory.saved principal=%d generation=%d facts=%d", principal, gen,
                 len(merged))

    def pending_of(self, principal: int) -> list[Pending]:
        return [p for p in self.pending if p.principal == principal]

    def decide_pending(self, principal: int, pending_id: int, approve: bool) -> None:
        """Approve (save) or reject one of the principal's pending facts (404 if none)."""
        p = next((p for p in self.pending if p.id == pending_id and p.principal == principal),
                 None)
        if p is None:
            raise DeviceError(404, Reason.NO_DECISION)
        self.pending.remove(p)
        self.decisions += 1
        if approve:
            self._save(p.principal, [p.fact])
        if not self.pending:
            self._on(E.DECIDED)

    def erase(self, principal: int) -> int:
        """Erase the principal's memory, and everything not yet processed that could
        bring it back; returns the generations removed."""
        removed = self.lineage(principal).erase()
        self.forget(principal)
        self._memory.pop(principal, None)
        return removed

    def forget(self, principal: int) -> None:
        """Drop a principal's unprocessed sources and pending facts (memory erase), so
        that nothing from before the erase is saved after it."""
        start = self.frontier + (1 if self.active is not None else 0)
        self.log[start:] = [s for s in self.log[start:] if s.principal != principal]
        if self.active is not None and self.log[self.frontier].principal == principal:
            self.discard_active = True
        self.pending = [p for p in self.pending if p.principal != principal]
