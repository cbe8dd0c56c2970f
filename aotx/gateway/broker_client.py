"""The gateway's side of ``service.sock``: an asyncio client that multiplexes calls.

Each call sends one packet with a fresh tag (header offset 16) and awaits the
reply with the same tag.  One connection carries any number of calls in flight.
When the connection breaks, every waiting call fails with
:class:`BrokerUnavailable` and the next call reconnects.

WAITs are the exception: the WAITs that streams send in the same turn of the event loop
(every stream a decode step advanced, once its SSE frame is written) leave as one WAITS
packet (docs/protocol.md, section 10.1), answered in one reply, so that a step costs the
broker and the device one packet for all of them instead of one each.  A member that
the reply answers with 204 (nothing new for it yet) joins the next group; its caller
sees only the WAIT's own answer.  While answered streams' WAITs are still to come, a
flusher task waits for them (``LINGER_S`` at most); otherwise (one stream) the WAITs
queued in a turn of the loop leave at its end, without a task.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from .. import wire

log = logging.getLogger("aotx.gateway.broker")
T = TypeVar("T")


class BrokerUnavailable(Exception):
    pass


class DeviceSilent(BrokerUnavailable):
    """The packet was sent but no reply came before the call's deadline."""


#: How long queued WAITs wait at most for the next WAITs of the other streams whose
#: replies came in the same burst (one device pass: one step's tokens).  Those streams
#: queue theirs within a few turns of the loop, so the wait ends early; the bound is
#: for a stream that ends or reads instead.  A WAIT parks on the device until the next
#: step ends anyway, so it is answered no later unless the step ended meanwhile.
LINGER_S = 0.001
READ_BURST = 256  # replies read in one turn of the loop at most


class BrokerClient:
    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[wire.Header, bytes]]] = {}
        self._tags = itertools.count(1)
        self._connect_lock = asyncio.Lock()
        # One sender at a time: the event loop keeps one pending writer per socket,
        # and a second ``sock_sendall`` waiting on a full socket would replace the
        # first's (whose call then never completes).
        self._send_lock = asyncio.Lock()
        self.packets_sent = 0
        self.waits_sent = 0  # WAITs sent, alone or as WAITS members (resends included)
        # WAITs to send in the next group, and their one sender while any are queued
        self._waits: list[tuple[wire.Header, asyncio.Future[tuple[wire.Header, bytes]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._soon: asyncio.Handle | None = None  # _send_queued, at the end of this turn
        self._arrived: asyncio.Future[None] | None = None  # set when a WAIT is queued
        self._expected = 0  # WAITs answered whose streams have not sent their next one
        self._groups: dict[int, list[int]] = {}  # a WAITS's tag -> its members' tags

    async def _ensure(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        async with self._connect_lock:
            if self._sock is not None:
                return self._sock
            # Any OSError, the socket's creation included (no file descriptor left), is
            # BrokerUnavailable: callers answer that with a fixed 503 and log its text.
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            except OSError as exc:
                raise BrokerUnavailable(f"no socket for the broker: {exc}") from None
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, self.path)
            except OSError as exc:
                sock.close()
                raise BrokerUnavailable(f"cannot reach the broker at {self.path}: {exc}") from None
            self._sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(sock))
            log.info("event=gateway.broker_connected socket=%s", self.path)
            return sock

    async def _read_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            data = await loop.sock_recv(sock, wire.MAX_PACKET + 1)
            burst = 0
            while data:
                self._deliver(data)
                burst += 1
                try:
                    # Every reply already here, in this turn of the loop (up to a burst):
                    # the replies of one device pass then wake their streams together,
                    # and the streams' next WAITs leave in one group.
                    if burst >= READ_BURST:
                        raise BlockingIOError
                    data = sock.recv(wire.MAX_PACKET + 1)
                except BlockingIOError:
                    data = await loop.sock_recv(sock, wire.MAX_PACKET + 1)
                    burst = 0
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._drop(sock)

    def _deliver(self, data: bytes) -> None:
        try:
            header, payload = wire.decode_packet(data)
        except wire.WireError as exc:
            log.warning("event=gateway.bad_reply error=%s", exc.message)
            return
        if header.op == wire.Op.WAITS:
            self._answer_group(header, payload)
            return
        fut = self._pending.pop(header.tag, None)
        if fut is not None and not fut.done():
            if header.op == wire.Op.WAIT and header.status != 204:
                # Its stream sends its next WAIT soon.  (A flagged WAIT's answer counts
                # too, though its next WAIT is not grouped: the next group then waits
                # LINGER_S at most.)
                self._expected += 1
            fut.set_result((header, payload))

    def _drop(self, sock: socket.socket) -> None:
        sock.close()
        if self._sock is not sock:
            return  # an earlier connection: its calls failed when it was dropped
        self._sock = None
        self._groups.clear()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(BrokerUnavailable("the broker connection closed"))

    async def call(self, header: wire.Header, payload: bytes = b"", timeout: float = 120.0,
                   settled: Callable[[], None] | None = None) -> tuple[wire.Header, bytes]:
        """The reply to one packet, within ``timeout`` seconds.

        ``settled`` is called once the device no longer holds the packet: when its reply
        comes (before this returns), when the connection drops, or at once when it was
        never sent.  A call that times out or is cancelled still holds its mailbox until
        then: its reply is awaited in the background, and dropped when it comes."""
        if header.op == wire.Op.WAIT and not header.flags and not payload:
            return await self._wait(header, timeout, settled)
        tag = next(self._tags)
        fut: asyncio.Future[tuple[wire.Header, bytes]] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(functools.partial(_settled, settled))
        sent = False
        try:
            packet = wire.encode_packet(header._replace(tag=tag), payload)
            await self._send(packet, functools.partial(self._pending.__setitem__, tag, fut))
            sent = True
            try:
                return await _kept(fut, timeout)
            except TimeoutError:
                raise DeviceSilent(f"no reply to op {header.op} in {timeout:g} s") from None
        finally:
            if not sent or fut.done():
                self._pending.pop(tag, None)
                fut.cancel()  # (never sent: settled now)

    async def _send(self, packet: bytes, register: Callable[[], None]) -> None:
        """Send ``packet`` on the connection as it is now (it may have been re-made while
        this call waited for the lock), its reply futures registered by ``register`` only
        then, so that a reply can only come for a packet that was sent on it."""
        async with self._send_lock:
            sock = await self._ensure()
            register()
            try:
                await asyncio.get_running_loop().sock_sendall(sock, packet)
            except OSError as exc:
                self._drop(sock)
                raise BrokerUnavailable(f"send to the broker failed: {exc}") from None
        self.packets_sent += 1

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        waits, self._waits = self._waits, []
        for _, fut in waits:
            if not fut.done():
                fut.set_exception(BrokerUnavailable("the broker client closed"))
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._drop(self._sock)

    # -- WAITs, sent in groups ---------------------------------------------------------------
    async def _wait(self, header: wire.Header, timeout: float,
                    settled: Callable[[], None] | None) -> tuple[wire.Header, bytes]:
        """A WAIT's answer: sent in the next group, and again (with what is left of its
        ``wait_ms``) after each 204 until the device answers it as a WAIT."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        wait_ms = wire.wait_timeout_ms(header)
        self._expected = max(0, self._expected - 1)  # (likely) one of those streams
        while True:
            left = wait_ms - int((loop.time() - start) * 1000)
            fut: asyncio.Future[tuple[wire.Header, bytes]] = loop.create_future()
            try:
                self._queue(header._replace(limit=max(1, left)), fut)
                rh, body = await _kept(fut, max(0.0, start + timeout - loop.time()))
            except BaseException as exc:
                self._give_up(fut, settled)
                if isinstance(exc, TimeoutError):
                    raise DeviceSilent(f"no reply to a WAIT in {timeout:g} s") from None
                raise
            if rh.status != 204:
                if settled is not None:
                    settled()
                return rh, body

    def _queue(self, h: wire.Header, fut: asyncio.Future[tuple[wire.Header, bytes]]) -> None:
        """Queue a WAIT for the next group.  With answered streams' WAITs to come, the
        flusher task waits for them (``LINGER_S`` at most); with none, the WAITs queued
        in this turn of the loop leave at its end, without a task (``_send_queued``)."""
        self._waits.append((h, fut))
        if self._flusher is not None:
            if self._arrived is not None:
                _settle(self._arrived)
        elif self._soon is None:
            loop = asyncio.get_running_loop()
            if self._expected:
                self._flusher = loop.create_task(self._flush_waits())
            else:
                self._soon = loop.call_soon(self._send_queued)

    def _send_queued(self) -> None:
        """Send the queued WAITs as one packet now, if nothing else is sending and the
        socket takes it at once; else leave them to the flusher."""
        self._soon = None
        if self._flusher is not None or not self._waits:
            return
        try:
            if not self._expected and len(self._waits) <= wire.WAITS_MAX and self._send_now():
                return
        except Exception as exc:  # (a packet that cannot be encoded: as a failed send)
            waits, self._waits = self._waits, []
            for _, fut in waits:
                if not fut.done():
                    fut.set_exception(BrokerUnavailable(f"a WAIT not sent: {exc}"))
            return
        self._flusher = asyncio.get_running_loop().create_task(self._flush_waits())

    def _send_now(self) -> bool:
        """Send every queued WAIT in one packet if the socket takes it without waiting
        (False: it did not, and they stay queued)."""
        sock = self._sock
        if sock is None or self._send_lock.locked():
            return False
        batch = [(h, fut) for h, fut in self._waits if not fut.done()]
        if batch:
            packet, tags, group = self._packet(batch)
            try:
                sock.send(packet)
            except BlockingIOError:
                return False
            except OSError as exc:
                self._waits.clear()
                self._drop(sock)
                for _, fut in batch:
                    fut.set_exception(BrokerUnavailable(f"send to the broker failed: {exc}"))
                return True
            self._register(batch, tags, group)
            self.packets_sent += 1
            self.waits_sent += len(batch)
        self._waits.clear()
        return True

    def _give_up(self, fut: asyncio.Future[tuple[wire.Header, bytes]],
                 settled: Callable[[], None] | None) -> None:
        """A WAIT whose caller stops waiting: still queued here, it is never sent;
        sent, the device holds it until it answers (at its wait_ms), and ``settled``
        is called then."""
        queued = [i for i, (_, f) in enumerate(self._waits) if f is fut]
        if queued:
            del self._waits[queued[0]]
            fut.cancel()
        if fut.done():  # never sent, or answered: settled now (calls.read then sends no UNPARK)
            _settled(settled, fut)
        else:
            fut.add_done_callback(functools.partial(_settled, settled))

    async def _flush_waits(self) -> None:
        """The one sender of queued WAITs: once every stream just answered has queued
        its next one (or ``LINGER_S`` passed), groups of up to WAITS_MAX, until none is
        left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_S
        try:
            while self._expected and loop.time() < deadline:
                arrived = self._arrived = loop.create_future()
                timer = loop.call_later(deadline - loop.time(), _settle, arrived)
                await arrived
                timer.cancel()
            self._expected = 0
            while self._waits:
                batch = [(h, fut) for h, fut in self._waits[:wire.WAITS_MAX] if not fut.done()]
                del self._waits[:wire.WAITS_MAX]
                if batch:
                    await self._send_group(batch)
        finally:
            self._flusher = self._arrived = None

    async def _send_group(self, batch: list[tuple[wire.Header,
                                                  asyncio.Future[tuple[wire.Header, bytes]]]]
                          ) -> None:
        packet, tags, group = self._packet(batch)

        def register() -> None:
            self._register(batch, tags, group)

        try:
            await self._send(packet, register)
            self.waits_sent += len(tags)
        except BrokerUnavailable as exc:
            for (_, fut), tag in zip(batch, tags, strict=True):
                self._pending.pop(tag, None)
                if not fut.done():
                    fut.set_exception(exc)

    def _packet(self, batch: list[tuple[wire.Header, asyncio.Future[tuple[wire.Header, bytes]]]]
                ) -> tuple[bytes, list[int], int]:
        """The packet for ``batch`` (one WAIT alone, or a WAITS group), its members' tags
        and the group's tag (0: alone)."""
        tags = [next(self._tags) for _ in batch]
        members = [h._replace(tag=tag) for (h, _), tag in zip(batch, tags, strict=True)]
        group = next(self._tags) if len(members) > 1 else 0
        packet = (wire.encode_packet(wire.Header.request(wire.Op.WAITS, tag=group,
                                                         member_count=len(members)),
                                     wire.encode_waits(members))
                  if group else wire.encode_packet(members[0]))
        return packet, tags, group

    def _register(self, batch: list[tuple[wire.Header, asyncio.Future[tuple[wire.Header, bytes]]]],
                  tags: list[int], group: int) -> None:
        """The batch's reply futures, registered once its packet is sent."""
        for (_, fut), tag in zip(batch, tags, strict=True):
            self._pending[tag] = fut
        if group:
            self._groups[group] = tags

    def _answer_group(self, header: wire.Header, payload: bytes) -> None:
        """A WAITS's reply: each member's own, or the group's refusal as each member's."""
        tags = self._groups.pop(header.tag, None)
        if tags is None:
            return
        if header.status == 200:
            try:
                answers = {rh.tag: (rh, body) for rh, body in wire.decode_wait_replies(payload)}
            except wire.WireError as exc:
                log.warning("event=gateway.bad_reply error=%s", exc.message)
                answers = {}
        else:  # refused whole (no mailbox, a malformed group): as each WAIT's own refusal
            answers = {tag: (header._replace(op=wire.Op.WAIT, tag=tag), payload) for tag in tags}
        for tag in tags:
            fut = self._pending.pop(tag, None)
            if fut is None or fut.done():
                continue
            if tag in answers:
                self._expected += answers[tag][0].status != 204
                fut.set_result(answers[tag])
            else:
                fut.set_exception(BrokerUnavailable("a WAITS reply without a member's answer"))


def _settled(settled: Callable[[], None] | None, fut: asyncio.Future[Any]) -> None:
    """A call's reply came, or it will never come (connection dropped, never sent)."""
    if not fut.cancelled():
        fut.exception()  # retrieved: nobody may await a call given up on
    if settled is not None:
        settled()


def _settle(fut: asyncio.Future[None], *_: object) -> None:
    if not fut.done():
        fut.set_result(None)


async def _kept(fut: asyncio.Future[T], timeout: float) -> T:
    """``fut``'s result within ``timeout`` seconds (else TimeoutError); neither the
    timeout nor the caller's cancellation cancels ``fut``.  (``asyncio.wait_for`` over
    ``asyncio.shield``, in one future and one timer instead of three futures, on the
    path of every streamed token.)"""
    if not fut.done():
        loop = fut.get_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        wake = functools.partial(_settle, waiter)
        fut.add_done_callback(wake)
        timer = loop.call_later(timeout, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            fut.remove_done_callback(wake)
        if not fut.done():
            raise TimeoutError
    return fut.result()
