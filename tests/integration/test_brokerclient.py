"""The gateway's broker client against a real SOCK_SEQPACKET peer that is slow to read."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time

from aotx import wire
from aotx.gateway.broker_client import BrokerClient

from ..helpers import short_tmpdir


def _slow_echo(listener: socket.socket, stall: float, stop: threading.Event) -> None:
    """Accept one connection, read nothing for ``stall`` seconds, then answer every
    packet with status 200 and the packet's size in ``total``."""
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
        h, payload = wire.decode_packet(data)
        conn.send(wire.encode_packet(h.reply(200, total=len(payload))))
    conn.close()


def test_calls_whose_sends_wait_for_a_full_socket_all_complete() -> None:
    """More ~64 KiB packets than the socket buffer holds, sent at once while the peer
    does not read: each call is sent in turn and answered (two pending sends on one
    socket would lose one, and its call would never end); a call cancelled while it
    waits to send leaves nothing behind."""
    state = short_tmpdir()
    path = os.path.join(state, "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
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
