"""A reasoning model's thinking, told from its answer.

A model whose chat template thinks (Qwen 3, DeepSeek R1, QwQ: the device marks its
requests' state with ``STATE_FLAG_THINKS``) writes ``<think>`` ... ``</think>`` before
its answer; a template that opens the block itself (DeepSeek R1's generation prompt
ends with ``<think>``: ``STATE_FLAG_THINK_OPEN``) has the output start inside it.  The
output's bytes stay as the model wrote them (the native route reads them whole); the
standard routes show the thinking apart: chat's ``reasoning_content``, a ``reasoning``
item on Responses, ``thinking`` blocks on Messages.  The answer is what follows
``</think>``, its leading blank lines dropped; tool calls and JSON are parsed in it.
An output cut off while thinking has no answer.  gpt-oss's analysis channel ends at its
final channel, or at the commentary channel of a tool call: that answer keeps the call's
``<|channel|>commentary`` header, which the tool parser reads (gateway/tools.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire

OPEN, CLOSE = wire.THINK_TAGS
#: gpt-oss's answer without thinking opens the final channel at once (dropped, as the
#: channels' markup is).
BARE_FINAL = "<|channel|>final<|message|>"


@dataclass(frozen=True)
class Think:
    """How a thinking request's output holds its thinking: the block's opening and
    closing texts, and whether the prompt opened the block."""

    opened: bool
    open: str = OPEN
    close: str = CLOSE

    @property
    def bare(self) -> str:
        """What opens an answer given without thinking (dropped), or ""."""
        return BARE_FINAL if self.channels else ""

    @property
    def channels(self) -> bool:
        return self.open == wire.CHANNEL_TAGS[0]

    def closing(self, text: str) -> tuple[int, int]:
        """Where the thinking in ``text`` ends and where its answer begins, or (-1, -1):
        at ``close``, or (gpt-oss) at a tool call's commentary channel, whose header
        stays with the answer."""
        at = text.find(self.close)
        if self.channels:
            call = text.find(wire.CHANNEL_CALL)
            if call >= 0 and (at < 0 or call < at):
                return call, call + len(wire.CHANNEL_START)
        return at, at + len(self.close) if at >= 0 else -1

    def split(self, text: str) -> tuple[str | None, str]:
        """(the thinking, or None without a think block; the answer) of a whole output."""
        body = text
        if not self.opened:
            stripped = text.lstrip()
            if not stripped.startswith(self.open):
                if self.bare and stripped.startswith(self.bare):
                    return None, stripped[len(self.bare):]
                return None, text
            body = stripped[len(self.open):]
        at, answer = self.closing(body)
        if at < 0:
            return body.strip("\n"), ""
        return body[:at].strip("\n"), body[answer:].lstrip("\n")

def mode(flags: int) -> Think | None:
    """How a request of these state flags thinks (None: it does not)."""
    if not flags & wire.STATE_FLAG_THINKS:
        return None
    opening, closing = wire.think_tags(flags)
    return Think(bool(flags & wire.STATE_FLAG_THINK_OPEN), opening, closing)


def split(flags: int, text: str) -> tuple[str | None, str]:
    """(the thinking, or None; the answer) of a whole output of a request of these state
    flags: the whole text is the answer of one that does not think."""
    thinks = mode(flags)
    return thinks.split(text) if thinks else (None, text)


def stream(flags: int) -> ThinkStream | None:
    """The splitter of a stream of a request of these state flags (None: it does not
    think, its text is all answer)."""
    thinks = mode(flags)
    return ThinkStream(thinks) if thinks else None


class ThinkStream:
    """A stream's text as ("thinking" | "answer", text) pieces, as it comes.  What could
    still be ``<think>`` at the start, or ``</think>`` at the end of the thinking, waits
    for the next characters; so do the newlines around the block's edges."""

    def __init__(self, think: Think) -> None:
        self.think = think
        self.open, self.close, self.bare = think.open, think.close, think.bare
        self.closings = (self.close, wire.CHANNEL_CALL) if think.channels else (self.close,)
        self.state = "thinking" if think.opened else "start"
        self.held = ""
        self.fresh = True  # at the thinking's start: its leading newlines go

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            stripped = self.held.lstrip()
            if any(len(stripped) < len(t) and t.startswith(stripped)
                   for t in (self.open, self.bare) if t):
                return out  # (maybe the block's opening: wait)
            if stripped.startswith(self.open):
                self.state, self.held = "thinking", stripped[len(self.open):]
            elif self.bare and stripped.startswith(self.bare):
                self.state, self.held = "answer", stripped[len(self.bare):]
            else:
                self.state = "answer"
        if self.state == "thinking":
            if self.fresh:
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return out
                self.fresh = False
            at, answer = self.think.closing(self.held)
            if at < 0:
                # (held: what may begin </think>, and the newlines before it)
                partial = max(_partial(self.held, t) for t in self.closings)
                cut = len(self.held[:len(self.held) - partial].rstrip("\n"))
                if cut:
                    out.append(("thinking", self.held[:cut]))
                self.held = self.held[cut:]
                return out
            thought = self.held[:at].rstrip("\n")
            if thought:
                out.append(("thinking", thought))
            self.state, self.held = "after", self.held[answer:]
        if self.state == "after":
            self.held = self.held.lstrip("\n")
            if not self.held:
                return out
            self.state = "answer"
        if self.state == "answer" and self.held:
            out.append(("answer", self.held))
            self.held = ""
        return out

    def end(self) -> list[tuple[str, str]]:
        """What is held when the output ends: the thinking's tail, or the answer."""
        held, self.held = self.held, ""
        if not held or self.state == "after":
            return []
        if self.state == "thinking":
            return [("thinking", held.rstrip("\n"))] if held.strip("\n") else []
        return [("answer", held)]


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could still begin ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:k])), 0)
