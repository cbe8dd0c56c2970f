"""How long the gateway waits for the device's reply to each operation.

A device that stopped answering (stopped, deadlocked, swapping) must cost a caller a
few seconds and a 503, not minutes: every broker call has a deadline.  The table below
says which budget each operation gets; the seconds come from
:class:`~aotx.config.Settings` (``AOTX_CALL_DEADLINE``, ``AOTX_MEDIA_DEADLINE``,
``AOTX_WAIT_MARGIN``).

* ``CONTROL``: the device's control thread answers at once (under the state lock, which
  no thread holds during a decode step), so seconds are plenty even on a busy machine.
* ``ADMIT``: a SUBMIT.  Text is admitted by the control thread (``CONTROL``); a
  submission with media parts goes to the media worker, which decodes images one
  submission at a time (up to a couple of seconds each on two cores, more while others
  queue ahead), so it gets the media deadline.
* ``WAIT``: the device holds a WAIT until its own ``wait_ms`` runs out, then answers; the
  deadline is that time plus a margin.
* ``WORK``: an EMBED.  The engine thread computes it between decode steps, behind the
  embeddings queued before it (a packet asks for about four decodes: routes_embeddings.py),
  so it gets the media deadline.

A call past its deadline has not been withdrawn: its packet stays in its mailbox, and a
device that is merely slow may still carry it out (a submission admitted then runs with
no one following it).  The supervisor restarts a device that stays silent
(:mod:`aotx.watchdog`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .. import wire
from ..config import Settings


class Budget(enum.Enum):
    CONTROL = "control"
    ADMIT = "admit"
    WAIT = "wait"
    WORK = "work"


#: Every operation's budget (tests/unit/test_deadlines.py checks that none is missing).
DEADLINES: dict[wire.Op, Budget] = {
    wire.Op.INFO: Budget.CONTROL,
    wire.Op.SUBMIT: Budget.ADMIT,
    wire.Op.READ: Budget.CONTROL,
    wire.Op.CANCEL: Budget.CONTROL,
    wire.Op.GRANT_INSTALL: Budget.CONTROL,
    wire.Op.GRANT_READ: Budget.CONTROL,
    wire.Op.WAIT: Budget.WAIT,
    wire.Op.WAITS: Budget.WAIT,  # built by the broker client: each member has its WAIT's
    wire.Op.MEDIA_PUT: Budget.CONTROL,  # a chunk is copied; the last one hashed
    wire.Op.MEDIA_LIST: Budget.CONTROL,
    wire.Op.SHARED_SAVE: Budget.CONTROL,  # reserved: refused at once
    wire.Op.SHARED_LOAD: Budget.CONTROL,
    wire.Op.POLICY: Budget.CONTROL,
    wire.Op.TELEMETRY: Budget.CONTROL,
    wire.Op.MEDIA_READ: Budget.CONTROL,
    wire.Op.MEDIA_DELETE: Budget.CONTROL,
    wire.Op.METRICS: Budget.CONTROL,
    wire.Op.BROKER_STATS: Budget.CONTROL,  # the broker answers it itself
    wire.Op.MEMORY: Budget.CONTROL,  # a principal's memory file, read or rewritten
    wire.Op.UNPARK: Budget.CONTROL,
    wire.Op.EMBED: Budget.WORK,  # computed by the engine thread, between decode steps
    wire.Op.MODELS: Budget.CONTROL,  # a read, or a load or unload asked (carried out later)
}


@dataclass(frozen=True)
class Deadlines:
    """The seconds of each budget (defaults: those of :class:`Settings`)."""

    control: float = Settings.call_deadline
    media: float = Settings.media_deadline
    wait_margin: float = Settings.wait_margin

    @classmethod
    def from_settings(cls, s: Settings) -> Deadlines:
        return cls(s.call_deadline, s.media_deadline, s.wait_margin)

    def of(self, h: wire.Header, media: bool = False) -> float:
        """Seconds to wait for the reply to ``h``; ``media``: a SUBMIT with media parts."""
        budget = DEADLINES[wire.Op(h.op)]
        if budget is Budget.WAIT:
            return h.wait_ms / 1000 + self.wait_margin
        if budget is Budget.ADMIT and media or budget is Budget.WORK:
            return self.media
        return self.control
