"""The supervisor's health check of the device: alive, but no longer answering?

The supervisor restarts a component whose process exits.  A device that is alive but
silent (stopped, deadlocked, thrashing) does not exit, and every call to it would wait
out its deadline for ever; so the supervisor asks it, through the broker like any
caller, and kills it when it stays silent.

Every :data:`CHECK_INTERVAL` seconds it sends an INFO packet and a BROKER_STATS packet on
``service.sock`` (one check in flight at a time).  The check's outcome:

* **answered**: the device replied to the INFO (any reply the device sends, late ones
  included, proves it alive);
* **silent**: the INFO had no reply within :data:`CHECK_DEADLINE` seconds while the
  broker answered its own BROKER_STATS (so the broker relays, and the device does not
  answer);
* **unknown**: the broker is down, restarting or not answering itself: that is the
  broker's failure, not the device's, and it says nothing about the device.

When every mailbox is taken (a busy device with many parked waits), the broker refuses
the INFO; the check then asks whether the device has replied to anything since the last
check (the broker's reply counters): if so it answered, else it is silent.

:class:`HangRule` decides, without I/O: nothing counts before the device first answered
in its current start (it loads its models first), an answer or an unknown check ends a
silent streak, and a streak of at least :data:`MIN_MISSES` silent checks spanning
``hang_seconds`` (``AOTX_HANG_SECONDS``, default 10) means hung.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import logging
import math
import socket
from dataclasses import dataclass, field

from . import wire

log = logging.getLogger("aotx.serve")

CHECK_INTERVAL = 2.0  #: seconds from one check to the next
CHECK_DEADLINE = 3.0  #: seconds the device has to answer a check's INFO
MIN_MISSES = 3  #: silent checks in a row, at least, before the device counts as hung


class Outcome(enum.Enum):
    ANSWERED = "answered"
    SILENT = "silent"
    UNKNOWN = "unknown"


@dataclass
class HangRule:
    """The hang decision for one start of the device (a new start: a new rule)."""

    hang_seconds: float = 10.0
    answered: bool = False  # the device has answered since it started
    silent_since: float | None = None  # when the first check of the silent streak was sent
    misses: int = 0

    def observe(self, outcome: Outcome, sent: float) -> None:
        """One check's outcome (``sent``: when the check was sent)."""
        if outcome is Outcome.ANSWERED:
            self.answered = True
        if outcome is not Outcome.SILENT or not self.answered:
            self.silent_since, self.misses = None, 0
            return
        if self.silent_since is None:
            self.silent_since = sent
        self.misses += 1

    def hung(self, now: float) -> bool:
        return (self.silent_since is not None and self.misses >= MIN_MISSES
                and now - self.silent_since >= self.hang_seconds)

    def silent_for(self, now: float) -> float:
        return 0.0 if self.silent_since is None else now - self.silent_since


@dataclass
class _Check:
    sent: float
    deadline: float  # infinite until the device first answered: its model is loading
    info_tag: int
    stats_tag: int
    info: wire.Header | None = None  # the INFO's reply (the device's or a broker refusal)
    stats: dict[str, int] | None = None


@dataclass
class DeviceWatch:
    """The checks over one connection to the broker, driven by the supervisor's loop."""

    socket_path: str
    hang_seconds: float = 10.0
    rule: HangRule = field(init=False)
    sock: socket.socket | None = None
    check: _Check | None = None
    next_check: float = 0.0
    epoch: int = 0  # the epoch of the device's latest reply
    stale_epoch: int = 0  # replies of this epoch come from a device that was replaced
    replies: int | None = None  # the broker's reply counters at the last check

    def __post_init__(self) -> None:
        self.rule = HangRule(self.hang_seconds)
        self._tags = itertools.count(1)

    def device_started(self) -> None:
        """A new device process: it has not answered yet (its models are loading).
        A check already sent stays in its mailbox; the new device answers it."""
        self.rule = HangRule(self.hang_seconds)
        self.stale_epoch = self.epoch

    def close(self) -> None:
        """Drop the connection (the broker is down, or the supervisor stops); a check in
        flight tells nothing."""
        self._close()

    def tick(self, now: float) -> bool:
        """Collect replies, settle the check in flight, send the next; True: hung."""
        self._receive(now)
        c = self.check
        if c is not None:
            outcome = self._outcome(c, now)
            if outcome is not None:
                self.rule.observe(outcome, c.sent)
                self.check = None
        if self.check is None and now >= self.next_check:
            self._send(now)
        return self.rule.hung(now)

    # -- the check ---------------------------------------------------------------------
    def _outcome(self, c: _Check, now: float) -> Outcome | None:
        """The check's outcome, or None while it can still be answered."""
        if c.info is not None and c.info.epoch:
            return Outcome.ANSWERED
        refused = c.info is not None and c.info.reason == wire.Reason.NO_MAILBOX
        if now < c.deadline and not (refused and c.stats is not None):
            return None
        if c.stats is None:
            return Outcome.UNKNOWN  # the broker did not answer either
        count = c.stats.get("replies", 0) + c.stats.get("dropped", 0)
        progressed = self.replies is not None and count > self.replies
        self.replies = count
        if c.info is not None and not refused:
            return Outcome.UNKNOWN  # another refusal from the broker: not the device's
        return Outcome.ANSWERED if progressed else Outcome.SILENT

    def _send(self, now: float) -> None:
        self.next_check = now + CHECK_INTERVAL
        sock = self._connect(now)
        if sock is None:
            return
        deadline = now + CHECK_DEADLINE if self.rule.answered else math.inf
        c = _Check(now, deadline, next(self._tags), next(self._tags))
        try:
            sock.send(wire.encode_packet(wire.Header(op=wire.Op.INFO, tag=c.info_tag)))
            sock.send(wire.encode_packet(wire.Header(op=wire.Op.BROKER_STATS, tag=c.stats_tag)))
        except OSError as exc:  # BlockingIOError included: a broker that does not read
            log.debug("event=serve.check_failed error=%s", exc)
            self._close()
            return
        self.check = c

    # -- the connection ------------------------------------------------------------------
    def _connect(self, now: float) -> socket.socket | None:
        if self.sock is not None:
            return self.sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(1.0)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            log.debug("event=serve.check_failed error=%s", exc)
            self.rule.observe(Outcome.UNKNOWN, now)
            return None
        sock.setblocking(False)
        self.sock = sock
        return sock

    def _close(self) -> None:
        """Drop the connection; the check in flight (its mailbox orphaned) is unknown."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.check is not None:
            self.rule.observe(Outcome.UNKNOWN, self.check.sent)
            self.check = None
        self.replies = None

    def _receive(self, now: float) -> None:
        while self.sock is not None:
            try:
                data = self.sock.recv(wire.MAX_PACKET + 1)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._close()
                return
            try:
                h, payload = wire.decode_packet(data)
            except wire.WireError:
                continue
            self._take(h, payload, now)

    def _take(self, h: wire.Header, payload: bytes, now: float) -> None:
        c = self.check
        if h.epoch:  # the device's reply (the broker's refusals carry no epoch)
            if h.epoch == self.stale_epoch:
                return  # from the device that was replaced: proves nothing now
            self.epoch = h.epoch
            if c is None or h.tag != c.info_tag:
                self.rule.observe(Outcome.ANSWERED, now)  # a late reply: alive all the same
                return
        if c is not None and h.tag == c.info_tag:
            c.info = h
        elif c is not None and h.tag == c.stats_tag and h.status == 200:
            with contextlib.suppress(ValueError):
                stats = json.loads(payload)
                if isinstance(stats, dict):
                    c.stats = {k: v for k, v in stats.items() if isinstance(v, int)}
