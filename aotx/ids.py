"""Request ids in text: ``req-<16 lowercase hex epoch digits>-<32 lowercase hex identity
digits>`` (the seed's form).  The wire carries the epoch and the 16-byte identity; the
gateway shows and parses this form, the device writes it in its log."""

from __future__ import annotations

_HEX = frozenset("0123456789abcdef")


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
