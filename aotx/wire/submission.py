"""The SUBMIT payload (messages, parts, stops, sampling, a constraint, tools) and the
EMBED payload (the inputs to embed)."""

from __future__ import annotations

import enum
import struct
from typing import Annotated, NamedTuple

from .enums import DIGEST_SIZE, MAX_PAYLOAD, PartKind, Reason, Role, WireError, _check_enum
from .table import F, layout

# -- Submission payload (docs/protocol.md section 5): the seed's u32 message_count, then
# message_count x { u32 role, u32 part_count, part_count x { u32 kind, u32 byte_count, bytes } };
# then our optional extensions: stop strings, the sampling record and bias pairs, a constraint.

MAX_MESSAGES = 4096
MAX_PARTS = 4096
MAX_STOPS = 16
#: Bytes in one stop string (UTF-8).  Output that could still be the start of a
#: stop string is held back and searched on every token, so the length is bounded.
MAX_STOP_BYTES = 1024
_U32 = struct.Struct("<I")
_U32x2 = struct.Struct("<II")


class Part(NamedTuple):
    kind: PartKind
    data: bytes  # UTF-8 text, or a 32-byte digest

    @property
    def text(self) -> str:
        return self.data.decode("utf-8")


class Message(NamedTuple):
    role: Role
    parts: tuple[Part, ...]


class Sampling(NamedTuple):
    """The sampler beyond temperature, top-p and seed: after the stop strings, a 32-byte
    record, then ``bias_count`` (u32 token, f32 bias) pairs.  Absent: all defaults."""

    top_k: Annotated[int, F("I", 0, False, "keep the k likeliest tokens (0: off)")] = 0
    min_p: Annotated[float, F("f", 4, False, "drop tokens below min_p x the likeliest's")] = 0.0
    presence: Annotated[float, F("f", 8, False, "presence penalty, -2..2")] = 0.0
    frequency: Annotated[float, F("f", 12, False, "frequency penalty, -2..2")] = 0.0
    repetition: Annotated[float, F("f", 16, False, "repetition penalty (1: off)")] = 1.0
    last_n: Annotated[int, F("I", 20, False, "penalties count the last n tokens (0: all)")] = 0
    bias_count: Annotated[int, F("I", 24, False, "logit-bias pairs that follow")] = 0
    logprobs: Annotated[int, F("I", 28, False, "0: off; k + 1: logprobs, k <= 20 alternatives")] = 0
    bias: tuple[tuple[int, float], ...] = ()


SAMPLING = layout(Sampling, 32)
_BIAS = struct.Struct("<If")
MAX_BIAS = 1024
MAX_TOP_LOGPROBS = 20


class EngineFeature(enum.IntEnum):
    """What a submission asked that its model's engine lacks (``Reason.ENGINE_FEATURE``)."""

    PENALTY_WINDOW = 2  #: ``Sampling.last_n`` (vLLM's penalties count all tokens)


class GrammarKind(enum.IntEnum):
    """What a submission's constraint is (the section after the logit-bias pairs)."""

    NONE = 0  #: no constraint (it holds the place of one when a tools section follows)
    JSON_SCHEMA = 1  #: UTF-8 JSON: a JSON schema the output must validate against
    LARK = 2  #: an llguidance Lark grammar
    REGEX = 3  #: a regular expression the whole output must match


class Constraint(NamedTuple):
    kind: GrammarKind
    text: str


class Submission(NamedTuple):
    messages: tuple[Message, ...]
    stop: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    constraint: Constraint | None = None
    tools: bytes = b""  #: UTF-8 JSON array: the tools the chat template renders (none: empty)
    #: UTF-8 JSON object: more variables for the chat template (chat_template_kwargs)
    template_args: bytes = b""


def _part(kind: int, data: bytes) -> Part:
    _check_enum(PartKind, kind, "part kind")
    if kind == PartKind.TEXT:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("text part is not valid UTF-8") from None
    elif kind == PartKind.TOKENS and (not data or len(data) % 4):
        raise WireError(f"a token part holds u32 token ids, not {len(data)} bytes")
    elif kind == PartKind.FIELDS:
        _json_text(data, "template fields", b"{")
    elif kind != PartKind.TOKENS and len(data) != DIGEST_SIZE:
        raise WireError(f"digest part must be exactly {DIGEST_SIZE} bytes, got {len(data)}")
    return Part(PartKind(kind), data)


def _json_text(data: bytes, what: str, opening: bytes) -> None:
    """JSON sections are parsed by the device; the codec checks their text and opening."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{what} are not valid UTF-8") from None
    if not data.lstrip().startswith(opening):
        raise WireError(f"{what} are not a JSON {'object' if opening == b'{' else 'array'}")


def encode_submission(sub: Submission) -> bytes:
    out = bytearray(_U32.pack(len(sub.messages)))
    for msg in sub.messages:
        out += _U32x2.pack(int(msg.role), len(msg.parts))
        for part in msg.parts:
            _part(int(part.kind), part.data)
            out += _U32x2.pack(int(part.kind), len(part.data)) + part.data
    if sub.constraint is not None and sub.constraint.kind == GrammarKind.NONE:
        raise WireError("a NONE constraint is written for tools only: give None")
    later = sub.tools or sub.template_args  # the sections after the constraint
    constraint = sub.constraint or (Constraint(GrammarKind.NONE, "") if later else None)
    extended = sub.sampling != Sampling() or constraint is not None
    if sub.stop or extended:  # the seed's layout exactly when there are none
        out += _U32.pack(len(sub.stop))
        for s in sub.stop:
            b = s.encode("utf-8")
            out += _U32.pack(len(b)) + b
    if extended:
        if len(sub.sampling.bias) > MAX_BIAS:
            raise WireError(f"more than {MAX_BIAS} logit-bias entries")
        try:
            out += SAMPLING.pack(*sub.sampling._replace(bias_count=len(sub.sampling.bias))[:-1])
            out += b"".join(_BIAS.pack(t, b) for t, b in sub.sampling.bias)
        except struct.error as exc:
            raise WireError(f"sampling field out of range: {exc}") from None
    if constraint is not None:
        text = constraint.text.encode("utf-8")
        out += _U32x2.pack(int(constraint.kind), len(text)) + text
    if later:  # (an empty tools section holds the place of none before template arguments)
        if sub.tools:
            _json_text(sub.tools, "tools", b"[")
        out += _U32.pack(len(sub.tools)) + sub.tools
    if sub.template_args:
        _json_text(sub.template_args, "template arguments", b"{")
        out += _U32.pack(len(sub.template_args)) + sub.template_args
    if len(out) > MAX_PAYLOAD:
        raise WireError(f"submission of {len(out)} bytes exceeds one packet", 413,
                        Reason.TOO_LARGE)
    return bytes(out)


class _Reader:
    """Bounds-checked reader over a payload: never reads past its end."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.pos = bytes(data), 0

    def u32(self) -> int:
        if self.pos + 4 > len(self.data):
            raise WireError("payload ends inside a 32-bit field")
        self.pos += 4
        return int.from_bytes(self.data[self.pos - 4:self.pos], "little")

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise WireError(f"count {n} overruns the payload")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def bounded(self, what: str, limit: int) -> int:
        n = self.u32()
        if n > limit:
            raise WireError(f"{what} {n} exceeds {limit}")
        return n


def decode_submission(data: bytes | memoryview) -> Submission:
    r = _Reader(data)
    messages = []
    n_messages = r.bounded("message count", MAX_MESSAGES)
    if not n_messages:
        raise WireError("a submission needs at least one message")
    for _ in range(n_messages):
        role = r.u32()
        _check_enum(Role, role, "message role")
        parts = [_part(r.u32(), r.take(r.u32()))
                 for _ in range(r.bounded("part count", MAX_PARTS))]
        messages.append(Message(Role(role), tuple(parts)))
    stops = []
    if r.pos < len(r.data):  # the stop-string extension
        for _ in range(r.bounded("stop count", MAX_STOPS)):
            raw = r.take(r.bounded("stop string bytes", MAX_STOP_BYTES))
            if not raw:
                raise WireError("empty stop string")
            try:
                stops.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise WireError("stop string is not valid UTF-8") from None
    sampling = _sampling(r) if r.pos < len(r.data) else Sampling()
    constraint = None
    if r.pos < len(r.data):  # the constraint: its kind, then its UTF-8 text
        kind = r.u32()
        _check_enum(GrammarKind, kind, "grammar kind")
        try:
            constraint = Constraint(GrammarKind(kind), r.take(r.u32()).decode("utf-8"))
        except UnicodeDecodeError:
            raise WireError("constraint text is not valid UTF-8") from None
        if kind == GrammarKind.NONE:
            if constraint.text:
                raise WireError("a NONE constraint has text")
            constraint = None
    tools = b""
    if r.pos < len(r.data):  # the tools the template renders: a JSON array
        tools = r.take(r.bounded("tools bytes", MAX_PAYLOAD))
        if tools:
            _json_text(tools, "tools", b"[")
    args = b""
    if r.pos < len(r.data):  # more variables for the template: a JSON object
        args = r.take(r.bounded("template argument bytes", MAX_PAYLOAD))
        _json_text(args, "template arguments", b"{")
    if r.pos != len(r.data):
        raise WireError(f"{len(r.data) - r.pos} trailing bytes after the payload")
    return Submission(tuple(messages), tuple(stops), sampling, constraint, tools, args)


def _sampling(r: _Reader) -> Sampling:
    """The sampling extension (after the stops): its record, then its bias pairs."""
    head = Sampling._make((*SAMPLING.unpack(r.take(SAMPLING.size)), ()))
    if (head.logprobs > MAX_TOP_LOGPROBS + 1 or head.bias_count > MAX_BIAS
            or not 0.0 <= head.min_p <= 1.0 or not head.repetition > 0.0 or not all(abs(x) <= 1e6 for x in head[2:4])):
        raise WireError("bad sampling record")  # (NaN fails every comparison)
    bias = tuple(_BIAS.iter_unpack(r.take(head.bias_count * _BIAS.size)))
    if not all(abs(b) <= 1e6 for _, b in bias):
        raise WireError("bad logit bias")
    return head._replace(bias_count=0, bias=bias)



# -- Embedding inputs (EMBED): u32 count, count x { u32 kind (1: UTF-8 text, 2: u32 token
# ids), u32 byte_count, bytes }, none empty.  The reply: count x embedding_dims f32, in order.

MAX_EMBED_INPUTS = 2048


def encode_embed(inputs: list[str] | list[list[int]]) -> bytes:
    raw = [(1, x.encode("utf-8")) if isinstance(x, str) else (2, struct.pack(f"<{len(x)}I", *x))
           for x in inputs]
    out = _U32.pack(len(raw)) + b"".join(_U32x2.pack(k, len(b)) + b for k, b in raw)
    if len(out) > MAX_PAYLOAD:
        raise WireError(f"embedding inputs of {len(out)} bytes exceed a packet", 413, Reason.TOO_LARGE)
    return out


def decode_embed(data: bytes | memoryview) -> list[str | tuple[int, ...]]:
    r, out = _Reader(data), []
    for _ in range(r.bounded("embedding input count", MAX_EMBED_INPUTS)):
        kind, raw = r.u32(), r.take(r.u32())
        if kind not in (1, 2) or not raw or kind == 2 and len(raw) % 4:
            raise WireError(f"bad embedding input: kind {kind}, {len(raw)} bytes")
        out.append(_part(PartKind.TEXT, raw).text if kind == 1 else struct.unpack(f"<{len(raw) // 4}I", raw))
    if not out or r.pos != len(r.data):
        raise WireError("no embedding input, or bytes after the inputs")
    return out
