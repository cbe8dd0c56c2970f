"""Request ids in text: ``req-<16 lowercase hex epoch digits>-<32 lowercase hex identity
digits>`` (the seed's form).  The wire carries the epoch and the 16-byte identity; the
gateway shows and parses this form, the device writes it in its log.

An epoch's high 16 bits are the device id (``aotx serve --device-id``, 0 by default),
the low 48 its activation count in the state folder: so an id's first four epoch digits
name the device, and a router sends every follow-up to that device by the id's prefix
alone (docs/scale-out.md).  An epoch is *ended* for a device when it is that device's
and older than its current one; any other epoch is foreign (404, not 410).
"""

from __future__ import annotations

_HEX = frozenset("0123456789abcdef")
DEVICE_SHIFT = 48
MAX_DEVICE_ID = (1 << 16) - 1
_COUNT = (1 << DEVICE_SHIFT) - 1


def make_epoch(device_id: int, count: int) -> int:
    """The epoch of ``device_id``'s ``count``-th activation."""
    if not 0 <= device_id <= MAX_DEVICE_ID or not 0 < count <= _COUNT:
        raise ValueError(f"no epoch for device {device_id}, activation {count}")
    return device_id << DEVICE_SHIFT | count


def device_of(epoch: int) -> int:
    return epoch >> DEVICE_SHIFT


def ended(epoch: int, current: int) -> bool:
    """``epoch`` is an earlier activation of the device now at ``current``."""
    return device_of(epoch) == device_of(current) and 0 < epoch & _COUNT < current & _COUNT


def format_request_id(epoch: int, identity: bytes) -> str:
    return f"req-{epoch:016x}-{identity.hex()}"


def parse_request_id(text: str) -> tuple[int, bytes] | None:
    """Parse a request id; ``None`` when malformed (callers answer 404)."""
    if len(text) != 53 or not text.startswith("req-") or text[20] != "-":
        return None
    e, ident = text[4:20], text[21:]
    if not (set(e) <= _HEX and set(ident) <= _HEX):
        return None
    return int(e, 16), bytes.fromhex(ident)
