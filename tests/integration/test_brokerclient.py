"""The gateway's broker client against a real SOCK_SEQPACKET peer that is slow to read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator

from aotx import wire
from aotx.gateway.broker_client import BrokerClient

from ..helpers import short_tmpdir


def _listen(state: str) -> tuple[str, socket.socket]:
    """A listening SOCK_SEQPACKET socket in ``state``, and its path."""
    path = os.path.join(state, "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    return path, listener


def _serve(listener: socket.socket, answer: Callable[[wire.Header, bytes], bytes],
           stop: threading.Event, stall: float = 0.0) -> None:
    """Accept one connection, read nothing for ``stall`` seconds, then send
    ``answer(header, payload)`` for every packet until ``stop``."""
    conn, _ = listener.accept()
    conn.settimeout(0.2)
    time.sleep(stall)
    while not stop.is_set():
        try:
            data = conn.recv(wire.MAX_PACKET + 1)
        except TimeoutError:
            continue
        if not data:
            break
        conn.send(answer(*wire.decode_packet(data)))
    conn.close()


def _slow_echo(listener: socket.socket, stall: float, stop: threading.Event) -> None:
    """Answer every packet, after ``stall`` seconds of reading nothing, with status 200
    and the packet's size in ``total``."""
    _serve(listener, lambda h, payload: wire.encode_packet(h.reply(200, total=len(payload))),
           stop, stall)


def test_calls_whose_sends_wait_for_a_full_socket_all_complete() -> None:
    """More ~64 KiB packets than the socket buffer holds, sent at once while the peer
    does not read: each call is sent in turn and answered (two pending sends on one
    socket would lose one, and its call would never end); a call cancelled while it
    waits to send leaves nothing behind."""
    state = short_tmpdir()
    path, listener = _listen(state)
    stop = threading.Event()
    peer = threading.Thread(target=_slow_echo, args=(listener, 0.5, stop), daemon=True)
    peer.start()
    size = wire.MAX_PAYLOAD

    async def main() -> tuple[list[int], int]:
        client = BrokerClient(path)
        calls = [asyncio.create_task(client.call(wire.Header(op=wire.Op.READ),
                                                 bytes([k]) * size, timeout=10))
                 for k in range(12)]
        await asyncio.sleep(0.2)
        calls[-1].cancel()  # waiting behind the full socket
        done = await asyncio.wait_for(asyncio.gather(*calls[:-1]), 15)
        left = len(client._pending)
        await client.close()
        return [h.total for h, _ in done], left

    try:
        totals, left = asyncio.run(main())
        assert totals == [size] * 11
        assert left == 0
    finally:
        stop.set()
        peer.join(5)
        listener.close()
        shutil.rmtree(state, ignore_errors=True)


def _group_peer(listener: socket.socket, seen: list[tuple[int, int]],
                stop: threading.Event) -> None:
    """Answer WAITs like a device whose requests each have one byte past cursor 0 on
    every odd identity and nothing yet on even ones: a WAIT alone at once (as a READ),
    a WAITS with every member (204 for the even ones at cursor 0; the second time an
    even member comes, its byte).  ``seen`` gets each packet's (op, members)."""
    asked: dict[bytes, int] = {}

    def answer(h: wire.Header, payload: bytes) -> bytes:
        if h.op != wire.Op.WAITS:
            seen.append((h.op, 1))
            return wire.encode_packet(h.reply(200, total=1), h.identity[:1])
        members = wire.decode_waits(h, payload)
        seen.append((h.op, len(members)))
        replies = []
        for m in members:
            asked[m.identity] = asked.get(m.identity, 0) + 1
            if m.identity[0] % 2 == 0 and asked[m.identity] == 1:
                replies.append((m.reply(204), b""))
            else:
                replies.append((m.reply(200, total=1), m.identity[:1]))
        return wire.encode_packet(h.reply(200, total=len(replies)),
                                  wire.encode_wait_replies(replies))

    _serve(listener, answer, stop)


@contextlib.contextmanager
def _grouping_peer() -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """A ``_group_peer`` listening: its socket's path, and the (op, members) it saw."""
    state = short_tmpdir()
    path, listener = _listen(state)
    stop = threading.Event()
    seen: list[tuple[int, int]] = []
    peer = threading.Thread(target=_group_peer, args=(listener, seen, stop), daemon=True)
    peer.start()
    try:
        yield path, seen
    finally:
        stop.set()
        peer.join(5)
        listener.close()
        shutil.rmtree(state, ignore_errors=True)


def wait(k: int) -> wire.Header:
    """A WAIT on the request whose identity is ``k`` sixteen times."""
    return wire.Header.request(wire.Op.WAIT, principal=7, identity=bytes([k]) * 16,
                               wait_ms=5000)


def test_waits_sent_together_travel_as_one_group() -> None:
    """Eight WAITs sent in one turn of the loop leave as one WAITS; each caller gets its
    own member's answer; the four answered 204 are sent again, together, and then get
    theirs; a lone WAIT leaves as a plain WAIT."""
    async def main(path: str) -> tuple[list[bytes], bytes]:
        client = BrokerClient(path)
        done = await asyncio.gather(*(client.call(wait(k), timeout=10) for k in range(1, 9)))
        alone, body = await client.call(wait(9), timeout=10)
        assert alone.status == 200 and not client._pending and not client._groups
        await client.close()
        return [b for h, b in done if h.status == 200 and h.op == wire.Op.WAIT], body

    with _grouping_peer() as (path, seen):
        bodies, alone = asyncio.run(main(path))
        assert bodies == [bytes([k]) for k in range(1, 9)] and alone == b"\x09"
        assert seen == [(wire.Op.WAITS, 8), (wire.Op.WAITS, 4), (wire.Op.WAIT, 1)]


def test_streams_that_start_together_on_a_connected_socket_send_one_group() -> None:
    """A lone WAIT leaves as a plain WAIT; then, on the connected socket and with no
    answered stream's WAIT to come, eight WAITs queued in one turn of the loop still
    leave as one WAITS (not one packet each), and the four answered 204 as another."""
    async def main(path: str) -> list[bytes]:
        client = BrokerClient(path)
        await client.call(wait(9), timeout=10)
        done = await asyncio.gather(*(client.call(wait(k), timeout=10) for k in range(1, 9)))
        await client.close()
        return [b for h, b in done if h.status == 200]

    with _grouping_peer() as (path, seen):
        assert asyncio.run(main(path)) == [bytes([k]) for k in range(1, 9)]
        assert seen == [(wire.Op.WAIT, 1), (wire.Op.WAITS, 8), (wire.Op.WAITS, 4)]


def test_a_wait_cancelled_before_it_left_is_settled_at_once_and_never_sent() -> None:
    """Two streams answered together: the one that goes on queues its next WAIT, which
    waits for the other's (LINGER_S); its client leaves meanwhile.  That WAIT is never
    sent, and is settled before the cancellation reaches its caller (so the gateway
    sends no UNPARK for it); the next WAIT is sent."""
    async def main(path: str) -> None:
        client = BrokerClient(path)
        await asyncio.gather(client.call(wait(1), timeout=10), client.call(wait(3), timeout=10))
        settled: list[bool] = []
        at_cancel: list[list[bool]] = []

        async def follow() -> None:  # (as calls.read: it decides on UNPARK right there)
            try:
                await client.call(wait(3), timeout=10, settled=lambda: settled.append(True))
            except asyncio.CancelledError:
                at_cancel.append(list(settled))
                raise

        task = asyncio.create_task(follow())
        await asyncio.sleep(0)  # queued: the flusher waits for the other stream's WAIT
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and at_cancel == [[True]]
        assert (await client.call(wait(3), timeout=10))[1] == b"\x03"
        await client.close()

    with _grouping_peer() as (path, seen):
        asyncio.run(main(path))
        assert seen == [(wire.Op.WAITS, 2), (wire.Op.WAIT, 1)]


def test_a_refused_group_is_each_members_refusal() -> None:
    """A WAITS the broker refuses (no mailbox) reaches every member as its own 503."""
    state = short_tmpdir()
    path, listener = _listen(state)

    def refuse() -> None:
        conn, _ = listener.accept()
        h, _ = wire.decode_packet(conn.recv(wire.MAX_PACKET + 1))
        conn.send(wire.encode_packet(h.refuse(503, wire.Reason.NO_MAILBOX)))
        conn.recv(1)
        conn.close()

    peer = threading.Thread(target=refuse, daemon=True)
    peer.start()

    async def main() -> list[wire.Header]:
        client = BrokerClient(path)
        waits = [wire.Header.request(wire.Op.WAIT, principal=7, identity=bytes([k]) * 16)
                 for k in (1, 2, 3)]
        done = await asyncio.gather(*(client.call(w, timeout=5) for w in waits))
        await client.close()
        return [h for h, _ in done]

    try:
        answers = asyncio.run(main())
        assert [(h.op, h.status, h.reason) for h in answers] == [
            (wire.Op.WAIT, 503, wire.Reason.NO_MAILBOX)] * 3
        assert len({h.tag for h in answers}) == 3
    finally:
        peer.join(5)
        listener.close()
        shutil.rmtree(state, ignore_errors=True)


def test_a_call_given_up_on_is_settled_only_when_its_reply_comes() -> None:
    """``settled`` says when the device no longer holds a packet: a call past its
    deadline, or cancelled (its client left), is settled by its late reply, not when
    its caller gives up; a reply that comes in time settles it as the call returns
    (issue 39: the gateway counted a principal's mailboxes by what it last asked for)."""
    state = short_tmpdir()
    path, listener = _listen(state)
    stop = threading.Event()
    late: list[bytes] = []

    def answer(h: wire.Header, payload: bytes) -> bytes:
        if payload == b"slow":
            time.sleep(0.6)
        return wire.encode_packet(h.reply(200))

    peer = threading.Thread(target=_serve, args=(listener, answer, stop), daemon=True)
    peer.start()

    async def main() -> None:
        client = BrokerClient(path)
        settled: list[str] = []
        h = wire.Header(op=wire.Op.READ)
        try:
            await client.call(h, b"slow", timeout=0.2, settled=lambda: settled.append("late"))
        except Exception as exc:
            late.append(type(exc).__name__.encode())
        assert settled == []  # timed out, still held
        await asyncio.sleep(0.6)
        assert settled == ["late"]  # its reply came
        await client.call(h, b"", timeout=5, settled=lambda: settled.append("quick"))
        await asyncio.sleep(0)
        assert settled == ["late", "quick"]
        task = asyncio.create_task(client.call(h, b"slow", timeout=5,
                                               settled=lambda: settled.append("left")))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.1)
        assert task.cancelled() and settled[-1] == "quick"  # still held
        await asyncio.sleep(0.6)
        assert settled[-1] == "left"
        await client.close()

    try:
        asyncio.run(main())
        assert late == [b"DeviceSilent"]
    finally:
        stop.set()
        peer.join(5)
        listener.close()
        shutil.rmtree(state, ignore_errors=True)
