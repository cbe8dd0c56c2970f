"""The broker: ``service.sock`` (AF_UNIX, SOCK_SEQPACKET) <-> mapped mailboxes.

The broker holds transport state only.  For each packet from a connected
gateway it takes a free mailbox, copies the packet in, publishes it to the
device (state 1) and rings the device's doorbell.  When the device publishes a
reply (state 2) and rings back, the broker copies the reply out, frees the
mailbox (state 0) and sends the reply to the connection that owns the mailbox,
if that connection still exists.  The last :data:`RESERVED_FOR_INFO` mailboxes are
kept for INFO packets, which take them only when no other is free: however many
mailboxes the callers' packets hold, the supervisor's health check and the gateway's
poll still reach a device that answers (aotx/watchdog.py).  A mailbox whose connection
went away stays
unavailable until its reply arrives; the reply is then dropped, so it can never
reach a newer connection.  After a broker restart, every mailbox not in state 0
is treated the same way (orphaned).

Only peers whose SO_PEERCRED uid equals the broker's own are served, and the
socket is a named file in a 0700 folder (never an abstract socket).  The broker
only ever calls ``send`` on client sockets: no ancillary data, so no file
descriptor can leave it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import socket
import struct

from .. import wire
from ..cpuslice import request_short_slice
from ..mailbox import FREE, REPLY, REQUEST, RESERVED_FOR_INFO, SCAN_ALL, Bell, Region
from ..paths import RuntimePaths

log = logging.getLogger("aotx.broker")

_PEERCRED = struct.Struct("3i")


class _Orphan:
    """Owner marker for mailboxes whose connection is gone."""


ORPHAN = _Orphan()


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return int(uid)


class Connection:
    _next_id = 0

    def __init__(self, sock: socket.socket) -> None:
        Connection._next_id += 1
        self.id = Connection._next_id
        self.sock = sock
        self.open = True
        # Packets waiting for a full socket, in order; while any wait, later ones
        # queue behind them (one writer task drains the queue).
        self.backlog: collections.deque[bytes] = collections.deque()


class Broker:
    def __init__(self, paths: RuntimePaths, mailboxes: int) -> None:
        self.paths = paths
        self.region = Region(paths.region, mailboxes)
        self.bell = Bell(paths.broker_bell, paths.device_bell)
        self.owner: list[Connection | _Orphan | None] = [None] * mailboxes
        self.free: collections.deque[int] = collections.deque()
        # (at least one mailbox stays for every packet: a region of one reserves none)
        self.reserved = frozenset(range(mailboxes - min(RESERVED_FOR_INFO, mailboxes - 1),
                                        mailboxes))
        self.free_reserved: collections.deque[int] = collections.deque()
        self.sequence = 0
        self.stats = collections.Counter[str]()
        self.connections: set[Connection] = set()
        orphans = 0
        for i in range(mailboxes):
            state = self.region.state(i)
            if state == FREE:
                self._freed(i)
            elif state == REPLY:
                # A reply that a previous broker never collected: drop it.
                self.region.release(i)
                self._freed(i)
                orphans += 1
            else:
                self.owner[i] = ORPHAN
                orphans += 1
        if orphans:
            log.info("event=broker.orphans count=%d", orphans)
        self._server: socket.socket | None = None
        self._stopping: asyncio.Event | None = None

    # -- device side -------------------------------------------------------
    def _on_bell(self) -> None:
        indices = self.bell.drain()
        if SCAN_ALL in indices:
            indices = list(range(self.region.count))
        for i in indices:
            if i >= self.region.count or self.region.state(i) != REPLY:
                continue
            packet = self.region.read(i)
            owner = self.owner[i]
            self.owner[i] = None
            self.region.release(i)
            self._freed(i)
            if isinstance(owner, Connection) and owner.open:
                self.stats["replies"] += 1
                self._send(owner, packet)
            else:
                self.stats["dropped"] += 1
                log.info("event=broker.reply_dropped mailbox=%d", i)

    def _send(self, conn: Connection, packet: bytes) -> None:
        if conn.backlog:  # earlier packets still wait for the socket: keep the order
            conn.backlog.append(packet)
            return
        try:
            conn.sock.send(packet)
        except BlockingIOError:
            # The gateway is not reading; queue the packet and drain on the loop.
            conn.backlog.append(packet)
            asyncio.get_running_loop().create_task(self._drain(conn))
        except OSError:
            self._close(conn)

    async def _drain(self, conn: Connection) -> None:
        """The connection's one writer while its socket is full (a second pending
        ``sock_sendall`` on one socket would replace the first's writer)."""
        loop = asyncio.get_running_loop()
        try:
            while conn.backlog and conn.open:
                await loop.sock_sendall(conn.sock, conn.backlog[0])
                conn.backlog.popleft()
        except OSError:
            self._close(conn)
        except Exception:  # never leave a backlog that no task drains
            log.exception("event=broker.send_failed conn=%d", conn.id)
            self._close(conn)
        finally:
            if not conn.open:
                conn.backlog.clear()

    # -- gateway side ------------------------------------------------------
    def _refuse(self, conn: Connection, data: bytes, status: int, reason: wire.Reason,
                message: str, detail: int = 0) -> None:
        """Answer a packet from the broker itself (bad packet or no mailbox): the status
        and reason in the header; the message stays in the log."""
        log.debug("event=broker.refused status=%d reason=%s error=%s", status, reason.name,
                  message)
        try:
            reply = wire.decode_header(data).refuse(status, reason, detail)
        except wire.WireError:
            # Undecodable: still echo the tag so the sender can match the refusal.
            tag = struct.unpack_from("<Q", data, 16)[0] if len(data) >= 24 else 0
            reply = wire.Header(op=wire.Op.INFO, status=status, tag=tag, reason=int(reason))
        self._send(conn, wire.encode_packet(reply))

    def _relay(self, conn: Connection, data: bytes) -> None:
        self.stats["packets"] += 1
        if len(data) > wire.MAX_PACKET:
            self._refuse(conn, data, 413, wire.Reason.TOO_LARGE, "packet exceeds 65536 bytes")
            return
        try:
            header, _ = wire.decode_packet(data)
        except wire.WireError as exc:
            self._refuse(conn, data, exc.status, exc.reason, exc.message, exc.detail)
            return
        if header.op == wire.Op.BROKER_STATS:
            try:
                wire.check_request(header)
            except wire.WireError as exc:
                self._refuse(conn, data, exc.status, exc.reason, exc.message, exc.detail)
                return
            stats = {**self.stats, **self.mailbox_counts(), "connections": len(self.connections),
                     "mailboxes": self.region.count}
            self._send(conn, wire.encode_packet(header.reply(200), json.dumps(stats).encode()))
            return
        pool = self.free if self.free or header.op != wire.Op.INFO else self.free_reserved
        if not pool:
            self.stats["busy"] += 1
            self._refuse(conn, data, 503, wire.Reason.NO_MAILBOX, "no free mailbox")
            return
        i = pool.popleft()
        self.owner[i] = conn
        self.sequence += 1
        self.region.publish(i, data, REQUEST, self.sequence)
        self.bell.ring(i)

    async def _serve_connection(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(conn.sock, wire.MAX_PACKET + 1)
                if not data:
                    break
                self._relay(conn, data)
        except OSError:
            pass
        finally:
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        if not conn.open:
            return
        conn.open = False
        self.connections.discard(conn)
        in_flight = 0
        for i, owner in enumerate(self.owner):
            if owner is conn:
                self.owner[i] = ORPHAN
                in_flight += 1
        conn.sock.close()
        log.info("event=broker.disconnect conn=%d in_flight=%d", conn.id, in_flight)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        path = self.paths.socket
        if os.path.exists(path):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            srv.bind(path)
        finally:
            os.umask(old)
        srv.listen(128)
        srv.setblocking(False)
        self._server = srv
        loop.add_reader(self.bell.fd, self._on_bell)
        self._on_bell_scan()
        log.info("event=broker.listening socket=%s mailboxes=%d", path, self.region.count)
        accept = loop.create_task(self._accept_loop(srv))
        await self._stopping.wait()
        accept.cancel()
        loop.remove_reader(self.bell.fd)
        srv.close()
        for conn in list(self.connections):
            self._close(conn)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _on_bell_scan(self) -> None:
        """Look for replies no doorbell announced (at start-up, then every second)."""
        for i in range(self.region.count):
            if self.region.state(i) == REPLY:
                self.bell.ring_self(SCAN_ALL)
                break
        if self._stopping is not None and not self._stopping.is_set():
            asyncio.get_running_loop().call_later(1.0, self._on_bell_scan)

    async def _accept_loop(self, srv: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        my_uid = os.getuid()
        while True:
            sock, _ = await loop.sock_accept(srv)
            uid = peer_uid(sock)
            if uid != my_uid:
                log.warning("event=broker.refused_peer uid=%d", uid)
                sock.close()
                continue
            sock.setblocking(False)
            conn = Connection(sock)
            self.connections.add(conn)
            log.info("event=broker.connect conn=%d", conn.id)
            loop.create_task(self._serve_connection(conn))

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    def _freed(self, i: int) -> None:
        (self.free_reserved if i in self.reserved else self.free).append(i)

    def mailbox_counts(self) -> dict[str, int]:
        counts = {"free": len(self.free) + len(self.free_reserved), "in_flight": 0,
                  "orphaned": 0}
        for owner in self.owner:
            if isinstance(owner, Connection):
                counts["in_flight"] += 1
            elif owner is ORPHAN:
                counts["orphaned"] += 1
        return counts


def run(paths: RuntimePaths, mailboxes: int, short_slice: bool = True) -> None:
    paths.ensure()
    request_short_slice(short_slice)
    broker = Broker(paths, mailboxes)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, broker.stop)
        await broker.serve()

    try:
        import uvloop  # the fast event loop uvicorn uses too

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    broker.region.close()
    log.info("event=broker.stopped")


__all__ = ["Broker", "run", "peer_uid", "FREE", "REQUEST", "REPLY"]
