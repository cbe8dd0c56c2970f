"""A response's stream events: a deterministic function of its output bytes and final
state, so that event N is the same event however the stream was watched, and a stream
resumes after event N (``starting_after``) by computing the events again from byte 0 of
the device's output and skipping the first N + 1.  Nothing is buffered for a replay.

The output is cut into **pieces** by its bytes alone (:func:`boundary`): a piece ends
where white space is followed by a byte that is not white space (a word and the space
after it), or at :data:`MAX_PIECE` bytes, moved back to the start of a UTF-8 character.
A cut depends only on the bytes before it and the one after it, so any prefix of the
output gives the same first pieces, however the bytes arrived; the rest is the last
piece once the request is terminal.  Each piece is one ``response.output_text.delta``
(with tools, what the tool stream lets through of it: gateway/tools.py ``ToolStream``).
A thinking model's pieces go through gateway/reasoning.py's ``ThinkStream`` first: its
thinking is a ``reasoning`` item's ``response.reasoning_text.delta`` events, before the
message (whether it thinks is read from the state that came with the first output
bytes, which is the same on every replay).  Every other event comes from the order
above and the terminal state; an item is opened with its first text (the message of a
text response at the end, when it has none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import wire
from . import reasoning
from . import tools as T
from .responses import call_item, item_status, message_item, reasoning_item

MAX_PIECE = 64  # bytes: the longest delta, so a text without spaces still streams
_SPACE = frozenset(b" \t\n\r")

Event = dict[str, Any]
Snapshot = Callable[[wire.Header, bytes, str | None], dict[str, Any]]


def boundary(buf: bytes | bytearray) -> int | None:
    """Where the first piece of ``buf`` ends, if its bytes decide it already."""
    for p in range(1, min(len(buf) - 1, MAX_PIECE) + 1):
        if buf[p - 1] in _SPACE and buf[p] not in _SPACE:
            return p
    if len(buf) <= MAX_PIECE:
        return None
    p = MAX_PIECE
    while p > 1 and buf[p] & 0xC0 == 0x80:  # not inside a character
        p -= 1
    return p


class Splitter:
    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out = []
        while (cut := boundary(self.buf)) is not None:
            out.append(bytes(self.buf[:cut]))
            del self.buf[:cut]
        return out

    def end(self) -> bytes:
        rest, self.buf = bytes(self.buf), bytearray()
        return rest


class Events:
    """The events of one response, numbered from 0: :meth:`start`, :meth:`feed` for
    each run of output bytes as they come, :meth:`end` with the terminal state."""

    def __init__(self, first: wire.Header, snapshot: Snapshot) -> None:
        self.identity = first.identity
        self.snapshot = snapshot
        self.seq = 0
        self.raw = bytearray()  # this stream's output so far, for the final snapshot
        self.split = Splitter()
        self.tools = (T.ToolStream("auto", first.identity,
                                   wire.submit_tool_format(first.submit_flags))
                      if first.submit_flags & wire.SUBMIT_FLAG_TOOLS else None)
        self.message: dict[str, Any] | None = None  # the open message item
        self.text = ""
        self.index = 0  # the next item's output_index
        self.at = 0  # the message's
        # a thinking model's: its splitter (decided with the first bytes), its open
        # reasoning item and its text
        self.think: reasoning.ThinkStream | None = None
        self.decided = False
        self.reasoning: dict[str, Any] | None = None
        self.thought = ""

    def _ev(self, kind: str, **fields: Any) -> Event:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self, first: wire.Header) -> list[Event]:
        return [self._ev("response.created", response=self.snapshot(first, b"", "queued")),
                self._ev("response.in_progress",
                         response=self.snapshot(first, b"", "in_progress"))]

    def _open(self) -> list[Event]:
        self.message = message_item(self.identity, "", "in_progress")
        self.at, self.index = self.index, self.index + 1
        item = {**self.message, "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._ev("response.output_item.added", output_index=self.at, item=item),
                self._ev("response.content_part.added", item_id=item["id"],
                         output_index=self.at, content_index=0, part=part)]

    def _delta(self, text: str) -> list[Event]:
        if self.tools is not None:
            text = self.tools.feed(text)
        if not text:
            return []
        out = self._open() if self.message is None else []
        self.text += text
        assert self.message is not None
        return out + [self._ev("response.output_text.delta", item_id=self.message["id"],
                               output_index=self.at, content_index=0, delta=text,
                               logprobs=[])]

    def feed(self, data: bytes, flags: int = 0) -> list[Event]:
        """The events of more output bytes; ``flags``: the state read with them."""
        self.raw += data
        return [ev for piece in self.split.feed(data)
                for ev in self._piece(piece.decode("utf-8", errors="replace"), flags)]

    def _piece(self, text: str, flags: int, final: bool = False) -> list[Event]:
        if not self.decided:
            self.decided = True
            self.think = reasoning.stream(flags)
        if self.think is None:
            return self._delta(text)
        out: list[Event] = []
        for kind, part in self.think.feed(text) + (self.think.end() if final else []):
            out += self._thinking(part) if kind == "thinking" else self._answer(part)
        return out

    def _thinking(self, text: str) -> list[Event]:
        out = []
        if self.reasoning is None:
            self.reasoning = {**reasoning_item(self.identity, "", "in_progress"),
                              "content": [], "output_index": self.index}
            self.index += 1
            item = {k: v for k, v in self.reasoning.items() if k != "output_index"}
            out.append(self._ev("response.output_item.added",
                                output_index=self.reasoning["output_index"], item=item))
        self.thought += text
        return out + [self._ev("response.reasoning_text.delta", item_id=self.reasoning["id"],
                               output_index=self.reasoning["output_index"], content_index=0,
                               delta=text)]

    def _answer(self, text: str, state: str = "completed") -> list[Event]:
        out = []
        if self.reasoning is not None and self.reasoning["status"] == "in_progress":
            self.reasoning["status"] = state
            rid, at = self.reasoning["id"], self.reasoning["output_index"]
            out = [self._ev("response.reasoning_text.done", item_id=rid, output_index=at,
                            content_index=0, text=self.thought),
                   self._ev("response.output_item.done", output_index=at,
                            item=reasoning_item(self.identity, self.thought, state))]
        return out + self._delta(text)

    def end(self, last: wire.Header) -> list[Event]:
        """The events after the last bytes: the rest of the text, the reasoning's, the
        message's and the calls' done events, and the terminal event."""
        out = self._piece(self.split.end().decode("utf-8", errors="replace"),
                          last.submit_flags, final=True)
        out += self._answer("", item_status(last))  # (the reasoning item, if still open)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            held = self.tools.held
            content, calls = T.parse(held, self.identity, self.tools.fmt)
            rest = held if not calls else content or ""
            if rest:
                self.tools = None  # the rest is content now: let it through whole
                out += self._delta(rest)
        if self.message is None and self.tools is None:  # a text response has its message
            out += self._open()
        out += self._close(item_status(last))
        for i, call in enumerate(calls, start=self.index):
            out += self._call(i, call_item(call))
        final = self.snapshot(last, bytes(self.raw), None)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(
            final["status"], "response.incomplete")  # incomplete, and cancelled
        return out + [self._ev(kind, response=final)]

    def _close(self, state: str) -> list[Event]:
        if self.message is None:
            return []
        item_id = self.message["id"]
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        return [self._ev("response.output_text.done", item_id=item_id, output_index=self.at,
                         content_index=0, text=self.text, logprobs=[]),
                self._ev("response.content_part.done", item_id=item_id, output_index=self.at,
                         content_index=0, part=part),
                self._ev("response.output_item.done", output_index=self.at,
                         item=message_item(self.identity, self.text, state))]

    def _call(self, index: int, item: dict[str, Any]) -> list[Event]:
        args = item["arguments"]
        out = [self._ev("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})]
        out += [self._ev("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=index, delta=args[at:at + T.ARGUMENT_CHUNK])
                for at in range(0, len(args), T.ARGUMENT_CHUNK)]
        return out + [self._ev("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, name=item["name"], arguments=args),
                      self._ev("response.output_item.done", output_index=index, item=item)]

