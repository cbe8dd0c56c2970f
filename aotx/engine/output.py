"""A request's published output: bytes are held back while they could still be the start
of a stop string or sit inside an incomplete UTF-8 sequence."""

from __future__ import annotations


def utf8_complete_length(data: bytes | bytearray) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n  # ASCII: complete
        if b >= 0xC0:  # lead byte
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n


def begun_length(data: bytes | bytearray, tag: bytes) -> int:
    """The length of the longest end of ``data`` that begins ``tag`` (shorter than it):
    such ends begin only where ``tag``'s first byte occurs, so jump between those (find)
    and compare each."""
    i = len(data) - min(len(tag) - 1, len(data))
    while (i := data.find(tag[:1], i)) >= 0:
        if tag.startswith(data[i:]):
            return len(data) - i
        i += 1
    return 0


class OutputBuffer:
    """Turns token pieces into published bytes, honouring stop strings.

    Bytes are held back while they could be the start of a stop string or sit
    inside an incomplete UTF-8 sequence; everything before is published.  When
    a stop string appears, the output ends just before it (the stop string is
    not part of the result, as in the OpenAI API).
    """

    def __init__(self, stops: tuple[bytes, ...] = ()) -> None:
        self.stops = stops
        self.held = bytearray()
        self.matched = -1  # the index of the stop string seen (the earliest in the output)

    def push(self, piece: bytes) -> tuple[bytes, bool]:
        """Add a piece; return (bytes to publish now, stop string seen)."""
        self.held += piece
        if self.stops:
            first = -1
            for n, s in enumerate(self.stops):
                k = self.held.find(s)
                if k >= 0 and (first < 0 or k < first):
                    first, self.matched = k, n
            if first >= 0:
                out = bytes(self.held[:first])
                self.held.clear()
                return out, True
        keep = max((begun_length(self.held, s) for s in self.stops), default=0)
        cut = len(self.held) - keep
        cut = utf8_complete_length(self.held[:cut])
        out = bytes(self.held[:cut])
        del self.held[:cut]
        return out, False

    def flush(self) -> bytes:
        """At the end: publish what is held, less an incomplete UTF-8 tail."""
        out = bytes(self.held[:utf8_complete_length(self.held)])
        self.held.clear()
        return out
