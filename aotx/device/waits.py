"""Parked WAITs: the WAIT packets (op 7) and WAIT groups (op 21, WAITS) the device holds
until their requests have something new (docs/protocol.md, section 10).

A WAIT is answered alone, as a READ would answer it then.  A WAITS carries up to
``wire.WAITS_MAX`` WAITs of one gateway connection in one packet, so that the streams a
decode step advances cost one mailbox, one doorbell ring and one broker send between
them, not one each.  It is answered as soon as one member has something new, or its
own timeout comes, in one reply that answers every member: as a READ would for each
member that has something new (or timed out, or whose request was cancelled, unparked
or reclaimed), with status 204 for the others, which the gateway sends again in its
next group.  Every member is checked (fields, grant, handle) as a WAIT of its own is,
and one member's refusal is that member's reply, not the group's.

Everything here runs on the control thread with the device lock held.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .. import wire
from ..engine.request import Request
from ..wire import Action, Header, Op
from .handlers import Handlers, Park, Reply, wait_ready
from .state import DeviceState

#: Device.reply_to: run a handler, its refusals and failures made replies.
ReplyTo = Callable[[Header, Callable[[], Reply | Park]], object]


@dataclass(eq=False)
class Parked:
    """One parked packet: a WAIT (``members`` is its own header) or a WAITS group."""

    mailbox: int
    header: Header
    members: tuple[Header, ...]
    deadlines: tuple[float, ...]


class Waits:
    def __init__(self, state: DeviceState, handlers: Handlers, reply_to: ReplyTo,
                 publish: Callable[[int, Header, bytes], None]) -> None:
        self.state = state
        self.handlers = handlers
        self.reply_to = reply_to
        self.publish = publish
        self.by_mailbox: dict[int, Parked] = {}
        self.by_identity: dict[bytes, list[Parked]] = {}

    def _reply(self, h: Header, work: Callable[[], Reply | Park]) -> Reply | Park:
        result = self.reply_to(h, work)
        assert isinstance(result, tuple | Park)
        return result

    # -- parking ------------------------------------------------------------------------------
    def park(self, mailbox: int, h: Header, members: tuple[Header, ...],
             deadlines: tuple[float, ...]) -> None:
        p = Parked(mailbox, h, members, deadlines)
        self.by_mailbox[mailbox] = p
        # Once per request: two members may follow the same one (two readers of it).
        for identity in dict.fromkeys(m.identity for m in members):
            self.by_identity.setdefault(identity, []).append(p)
        self.handlers.parked_waits += len(members)

    def _unpark(self, p: Parked) -> None:
        del self.by_mailbox[p.mailbox]
        for identity in dict.fromkeys(m.identity for m in p.members):
            held = self.by_identity[identity]
            held.remove(p)
            if not held:
                del self.by_identity[identity]
        self.handlers.parked_waits -= len(p.members)

    def open_group(self, mailbox: int, h: Header, payload: bytes) -> Reply | None:
        """A WAITS from the broker: its reply now, or None once it is parked."""
        wire.check_request(h)
        members = wire.decode_waits(h, payload)
        share = wire.waits_share(len(members))
        results = [self._reply(m, functools.partial(self._first, m, share)) for m in members]
        parks = [r for r in results if isinstance(r, Park)]
        if len(parks) == len(results):
            self.park(mailbox, h, tuple(members), tuple(r.deadline for r in parks))
            return None
        return self._pack(h, [r if isinstance(r, tuple) else self._not_yet(m)
                              for m, r in zip(members, results, strict=True)])

    def _first(self, m: Header, share: int) -> Reply | Park:
        wire.check_request(m)  # each member as a WAIT of its own: unused fields zero
        return self.handlers.read(m, share)

    # -- answering ------------------------------------------------------------------------
    def settle(self, now: float) -> None:
        """Answer every parked packet one of whose members is due."""
        for p in list(self.by_mailbox.values()):
            if any(self._due(m, d, now) for m, d in zip(p.members, p.deadlines, strict=True)):
                self._answer(p, now)

    def force(self, identity: bytes) -> None:
        """Answer now every packet with a WAIT on ``identity`` (cancelled, or its stream
        closed): that member as a READ would be, a group's others as due or 204."""
        for p in list(self.by_identity.get(identity, ())):
            self._answer(p, 0.0, identity)

    def next_deadline(self, now: float, longest: float) -> float:
        """Seconds until the first member's timeout, at most ``longest``."""
        for p in self.by_mailbox.values():
            longest = min(longest, max(0.0, min(p.deadlines) - now))
        return longest

    def _due(self, m: Header, deadline: float, now: float) -> bool:
        req = self.state.requests.get(m.identity)
        return req is None or now >= deadline or wait_ready(req, m)

    def _answer(self, p: Parked, now: float, forced: bytes = b"") -> None:
        self._unpark(p)
        if p.header.op == Op.WAIT:
            self.publish(p.mailbox, *self._read(p.header, 0))
            return
        share = wire.waits_share(len(p.members))
        replies = [self._read(m, share) if m.identity == forced or self._due(m, d, now)
                   else self._not_yet(m) for m, d in zip(p.members, p.deadlines, strict=True)]
        self.publish(p.mailbox, *self._pack(p.header, replies))

    def _read(self, m: Header, limit: int) -> Reply:
        """``m`` answered as a READ would be now (404 if its request was reclaimed)."""
        def read() -> Reply:
            req: Request = self.state.lookup(m, Action.READ)
            return self.handlers.read_reply(req, m, limit)
        reply = self._reply(m, read)
        assert isinstance(reply, tuple)
        return reply

    def _not_yet(self, m: Header) -> Reply:
        return m.reply(204, epoch=self.state.epoch), b""

    def _pack(self, h: Header, replies: list[Reply]) -> Reply:
        return (h.reply(200, epoch=self.state.epoch, total=len(replies)),
                wire.encode_wait_replies(replies))
