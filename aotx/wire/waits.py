"""WAITS: several WAIT headers in one packet, and their replies with a window each."""

from __future__ import annotations

from collections.abc import Sequence

from .enums import HEADER_SIZE, MAX_PAYLOAD, Op, WireError
from .header import Header, decode_header, encode_packet

# -- WAITS (docs/protocol.md section 10.1): ``member_count`` WAIT headers (no payloads, no
# flags) in; in the reply, each one's reply header and window, in the same order.

WAITS_MAX = 32  # members a packet: each member's window share is then >= 1,916 bytes
WAIT_DEFAULT_MS, WAIT_MAX_MS = 15_000, 60_000  # a WAIT's wait_ms of 0, and the most taken


def wait_timeout_ms(h: Header) -> int:
    """A WAIT's timeout as the device takes it (section 10)."""
    return min(h.wait_ms or WAIT_DEFAULT_MS, WAIT_MAX_MS)


def waits_share(count: int) -> int:
    """The most output bytes one of ``count`` members' windows may carry in the reply."""
    return (MAX_PAYLOAD - count * HEADER_SIZE) // count


def encode_waits(members: Sequence[Header]) -> bytes:
    return b"".join(encode_packet(m) for m in members)


def decode_waits(h: Header, payload: bytes | memoryview) -> list[Header]:
    count = h.member_count
    if not 1 <= count <= WAITS_MAX:
        raise WireError(f"a WAITS carries 1 to {WAITS_MAX} WAITs, not {count}")
    if len(payload) != count * HEADER_SIZE:
        raise WireError(f"a WAITS of {count} WAITs is {count * HEADER_SIZE} bytes, "
                        f"not {len(payload)}")
    members = [decode_header(payload[i:i + HEADER_SIZE])
               for i in range(0, len(payload), HEADER_SIZE)]
    for m in members:
        if m.op != Op.WAIT or m.payload_length or m.flags:
            raise WireError("a WAITS member must be a WAIT without payload or flags")
    return members


def encode_wait_replies(replies: Sequence[tuple[Header, bytes]]) -> bytes:
    return b"".join(encode_packet(rh, body) for rh, body in replies)


def decode_wait_replies(payload: bytes | memoryview) -> list[tuple[Header, bytes]]:
    out, at = [], 0
    while at < len(payload):
        rh = decode_header(payload[at:at + HEADER_SIZE])
        end = at + HEADER_SIZE + rh.payload_length
        if end > len(payload):
            raise WireError("a WAITS reply member runs past the payload")
        out.append((rh, bytes(payload[at + HEADER_SIZE:end])))
        at = end
    return out
