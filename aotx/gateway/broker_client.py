"""The gateway's side of ``service.sock``: an asyncio client that multiplexes calls.

Each call sends one packet with a fresh tag (header offset 16) and awaits the
reply with the same tag.  One connection carries any number of calls in flight.
When the connection breaks, every waiting call fails with
:class:`BrokerUnavailable` and the next call reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket

from .. import wire

log = logging.getLogger("aotx.gateway.broker")


class BrokerUnavailable(Exception):
    pass


class DeviceSilent(BrokerUnavailable):
    """The packet was sent but no reply came before the call's deadline."""


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
            while True:
                data = await loop.sock_recv(sock, wire.MAX_PACKET + 1)
                if not data:
                    break
                try:
                    header, payload = wire.decode_packet(data)
                except wire.WireError as exc:
                    log.warning("event=gateway.bad_reply error=%s", exc.message)
                    continue
                fut = self._pending.pop(header.tag, None)
                if fut is not None and not fut.done():
                    fut.set_result((header, payload))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        sock.close()
        if self._sock is not sock:
            return  # an earlier connection: its calls failed when it was dropped
        self._sock = None
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(BrokerUnavailable("the broker connection closed"))

    async def call(self, header: wire.Header, payload: bytes = b"",
                   timeout: float = 120.0) -> tuple[wire.Header, bytes]:
        tag = next(self._tags)
        packet = wire.encode_packet(header._replace(tag=tag), payload)
        fut: asyncio.Future[tuple[wire.Header, bytes]] = asyncio.get_running_loop().create_future()
        try:
            async with self._send_lock:
                # The connection as it is now (it may have been re-made while this
                # call waited for the lock); registered only now, so a reply can
                # only come for a packet that was sent on it.
                sock = await self._ensure()
                self._pending[tag] = fut
                try:
                    await asyncio.get_running_loop().sock_sendall(sock, packet)
                except OSError as exc:
                    self._drop(sock)
                    raise BrokerUnavailable(f"send to the broker failed: {exc}") from None
            self.packets_sent += 1
            try:
                return await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise DeviceSilent(f"no reply to op {header.op} in {timeout:g} s") from None
        finally:
            self._pending.pop(tag, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._drop(self._sock)
