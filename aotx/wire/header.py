"""The 128-byte header: its table, named accessors, the packet codec and the rule that a
request's unused fields are zero (:func:`check_request`)."""

from __future__ import annotations

import operator
import struct
from typing import Annotated, Any, NamedTuple

from .enums import (
    CANCEL_FLAG_ADMIN,
    HEADER_SIZE,
    MAGIC,
    MAX_PACKET,
    MAX_PAYLOAD,
    MEDIA_FLAG_ABORT,
    MEDIA_FLAG_EPHEMERAL,
    MEDIA_FLAG_FINAL,
    READ_FLAG_ANNOTATIONS,
    SUBMIT_DRY_ONLY,
    SUBMIT_FLAG_DRY,
    SUBMIT_FLAG_KEEP_ALIVE,
    SUBMIT_FLAG_MEMORY_OFF,
    SUBMIT_FLAG_RAW,
    SUBMIT_FLAG_SEED,
    SUBMIT_FLAG_TOOLS,
    SUBMIT_TOOL_FORMAT,
    VERSION,
    ZERO_IDENTITY,
    Finish,
    Op,
    Phase,
    Reason,
    WireError,
    _check_enum,
)
from .table import F, _View, layout, rows


class _Fields(NamedTuple):
    """The header's fields in wire order; :class:`Header` adds the accessors."""

    magic: Annotated[int, F("I", 0, False, "0x58544F41, the bytes AOTX")] = MAGIC
    version: Annotated[int, F("H", 4, False, "1")] = VERSION
    op: Annotated[int, F("H", 6, False, "`Op`")] = 0
    status: Annotated[int, F("I", 8, True, "Reply: HTTP-like status. Request: 0.")] = 0
    phase: Annotated[int, F("I", 12, True, "Reply: the request's `Phase`. WAIT: the phase last seen.")] = 0
    tag: Annotated[int, F("Q", 16, False, "Chosen by the requester, echoed in its reply")] = 0
    principal: Annotated[int, F("I", 24, False, "The principal id, relayed by the gateway (0 reserved)")] = 0
    reason: Annotated[int, F("I", 28, False, "Reply: `Reason` of a refusal, a failed request or a refused source. Request: 0.")] = 0
    revision: Annotated[int, F("Q", 32, False, "Reply: the grant revision the request was admitted under")] = 0
    epoch: Annotated[int, F("Q", 40, True, "Runtime epoch. Request: the handle's. Reply: the device's.")] = 0
    identity: Annotated[bytes, F("16s", 48, False, "Request identity; a source or upload id for media operations")] = ZERO_IDENTITY
    cursor: Annotated[int, F("Q", 64, True, "Byte cursor: the wanted offset, echoed in the reply")] = 0
    role: Annotated[int, F("I", 72, True, "Model role")] = 0
    total: Annotated[int, F("I", 76, True, "Total output bytes so far")] = 0
    prompt_tokens: Annotated[int, F("I", 80, True, "Prompt tokens")] = 0
    sampled_tokens: Annotated[int, F("I", 84, True, "Tokens sampled so far, end of generation included")] = 0
    payload_length: Annotated[int, F("I", 88, True, "Exact payload size")] = 0
    finish: Annotated[int, F("I", 92, True, "`Finish`")] = 0
    failure: Annotated[int, F("I", 96, True, "HTTP-like status of a failed request")] = 0
    cancel_requested: Annotated[int, F("I", 100, True, "0 or 1. WAIT: the value last seen.")] = 0
    limit: Annotated[int, F("I", 104, False, "A per-operation limit")] = 0
    temperature: Annotated[float, F("f", 108, False, "SUBMIT: temperature (<= 0: greedy)")] = 0.0
    top_p: Annotated[float, F("f", 112, False, "SUBMIT: top-p (outside (0, 1]: 1.0)")] = 0.0
    flags: Annotated[int, F("I", 116, False, "Per-operation flags")] = 0
    value: Annotated[int, F("Q", 120, False, "A per-operation number")] = 0

class Header(_Fields):
    """An immutable header value: build a request with :meth:`request`, a reply with
    :meth:`reply` or :meth:`refuse`; a field with per-operation meanings is set and read by
    the named accessor of the meaning at hand (a WAIT timeout is ``wait_ms``, not ``limit``)."""

    __slots__ = ()

    # -- named accessors: (field, when) ------------------------------------------------
    source_id = _View[bytes]("identity", "MEDIA_READ, MEDIA_DELETE; MEDIA_PUT reply")
    upload_id = _View[bytes]("identity", "MEDIA_PUT request")
    first_principal = _View[int]("cursor", "GRANT_READ")
    next_position = _View[int]("cursor", "MEDIA_LIST reply")
    pending_id = _View[int]("cursor", "MEMORY approve, reject")
    content_type = _View[int]("role", "MEDIA_PUT; its reply; MEDIA_READ reply")
    memory_op = _View[int]("role", "MEMORY")
    row_count = _View[int]("total", "GRANT_INSTALL, GRANT_READ; MEDIA_LIST reply")
    member_count = _View[int]("total", "WAITS and its reply: the WAITs it carries")
    max_tokens = _View[int]("limit", "SUBMIT: output tokens, 0 = as many as fit")
    first_item = _View[int]("limit", "SUBMIT with SUBMIT_FLAG_DRY: the first token (byte of "
                                     "the rendering) its reply lists")
    wait_ms = _View[int]("limit", "WAIT: timeout; EMBED: how long its caller waits")
    max_rows = _View[int]("limit", "MEDIA_LIST")
    retry_after = _View[int]("limit", "429 reply: seconds")
    submit_flags = _View[int]("flags", "SUBMIT: SUBMIT_FLAG_*; a state reply: the kept ones")
    cancel_flags = _View[int]("flags", "CANCEL: CANCEL_FLAG_*")
    media_flags = _View[int]("flags", "MEDIA_PUT: MEDIA_FLAG_*")
    seed = _View[int]("value", "SUBMIT, with SUBMIT_FLAG_SEED")
    keep_alive_ms = _View[int]("cursor", "SUBMIT, with SUBMIT_FLAG_KEEP_ALIVE: how long its "
                                         "model stays loaded idle after it; KEEP_ALIVE_FOREVER")
    detail = _View[int]("value", "refusal: the number its reason names")
    stop_hit = _View[int]("value", "a request's state: the stop string it ended on, its "
                                   "index + 1 (0: none)")
    reasoning_tokens = _View[int]("limit", "a request's state: the tokens sampled in its "
                                           "think block (STATE_FLAG_THINKS)")
    thought_budget = _View[int]("sampled_tokens", "SUBMIT: the most tokens of its think block, "
                                                  "then the model must close it (0: none)")

    # -- requests and replies ------------------------------------------------------------
    @classmethod
    def request(cls, op: Op, **fields: Any) -> Header:
        """A request of ``op``; a field may be named by its accessor (``wait_ms=`` sets limit)."""
        return cls(op=op, **{_VIEWS.get(k, k): v for k, v in fields.items()})

    def reply(self, status: int, **fields: Any) -> Header:
        """A reply to this request: its op, tag, principal, epoch, identity and cursor."""
        base = {"op": self.op, "tag": self.tag, "principal": self.principal, "epoch": self.epoch,
                "identity": self.identity, "cursor": self.cursor}
        return Header(status=status, **{**base, **fields})

    def refuse(self, status: int, reason: Reason, detail: int = 0, retry_after: int = 0, /,
               **fields: Any) -> Header:
        """A refusal: status, reason, its number; ``fields`` (a 409's state) never replace them."""
        return self.reply(status, **{**fields, "reason": int(reason), "value": detail,
                                     "limit": retry_after})


#: The header table: (field name, its row), in offset order.
HEADER_FIELDS = rows(_Fields)
#: Named accessor -> the field it reads.
_VIEWS = {name: v.field for name, v in vars(Header).items() if isinstance(v, _View)}
_HEADER = layout(_Fields, HEADER_SIZE)
_PAYLOAD_LENGTH = Header._fields.index("payload_length")


def decode_header(data: bytes | memoryview) -> Header:
    if len(data) < HEADER_SIZE:
        raise WireError(f"packet of {len(data)} bytes is shorter than the header")
    h = Header._make(_HEADER.unpack_from(data))
    if h.magic != MAGIC:
        raise WireError("bad magic")
    if h.version != VERSION:
        raise WireError(f"unsupported protocol version {h.version}", 505, Reason.VERSION)
    _check_enum(Op, h.op, "operation")
    _check_enum(Phase, h.phase, "phase")
    _check_enum(Finish, h.finish, "finish")
    _check_enum(Reason, h.reason, "reason")
    if h.cancel_requested not in (0, 1):
        raise WireError("cancel_requested must be 0 or 1")
    if h.payload_length > MAX_PAYLOAD:
        raise WireError(f"payload length {h.payload_length} exceeds {MAX_PAYLOAD}", 413,
                        Reason.TOO_LARGE)
    return h


def encode_packet(header: Header, payload: bytes = b"") -> bytes:
    """The header, its payload_length set to the payload's (``header`` stays as it is)."""
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}", 413,
                        Reason.TOO_LARGE)
    values = list(header)
    values[_PAYLOAD_LENGTH] = len(payload)
    try:
        return _HEADER.pack(*values) + payload
    except struct.error as exc:
        raise WireError(f"header field out of range: {exc}") from None


def decode_packet(data: bytes | memoryview) -> tuple[Header, bytes]:
    """Split one packet into its header and exact payload."""
    if len(data) > MAX_PACKET:
        raise WireError(f"packet of {len(data)} bytes exceeds {MAX_PACKET}", 413,
                        Reason.TOO_LARGE)
    header = decode_header(data)
    end = HEADER_SIZE + header.payload_length
    if len(data) != end:
        raise WireError(
            f"payload length {header.payload_length} disagrees with packet size {len(data)}")
    return header, bytes(data[HEADER_SIZE:end])


# -- Unused request fields are zero (the seed): a request that sets a field other than its
# operation's (and magic, version, op, tag, payload length) gets 400 NONZERO_FIELD.

REQUEST_FIELDS: dict[Op, tuple[str, ...]] = {
    Op.INFO: (), Op.BROKER_STATS: (), Op.SHARED_SAVE: (), Op.SHARED_LOAD: (),
    Op.SUBMIT: ("principal", "role", "limit", "temperature", "top_p", "flags", "value",
                "cursor", "sampled_tokens"),
    Op.READ: ("principal", "epoch", "identity", "cursor", "flags"),
    Op.WAIT: ("principal", "epoch", "identity", "cursor", "phase", "cancel_requested", "limit",
              "flags"),
    Op.CANCEL: ("principal", "epoch", "identity", "flags"),
    Op.UNPARK: ("principal", "epoch", "identity"),
    Op.GRANT_INSTALL: ("total",), Op.GRANT_READ: ("cursor",),
    Op.MEDIA_PUT: ("principal", "identity", "cursor", "role", "flags"),
    Op.MEDIA_LIST: ("principal", "cursor", "limit"),
    Op.MEDIA_READ: ("principal", "identity"), Op.MEDIA_DELETE: ("principal", "identity"),
    Op.POLICY: ("principal", "epoch"), Op.TELEMETRY: ("principal",),
    Op.METRICS: ("principal",), Op.MEMORY: ("principal", "role", "cursor"),
    Op.EMBED: ("principal", "role", "cursor", "identity", "limit"),
    Op.WAITS: ("total",), Op.MODELS: ("principal", "epoch"),
}
#: The flag bits each operation defines; other bits are unused, so zero.
REQUEST_FLAGS: dict[int, int] = {
    Op.SUBMIT: (SUBMIT_FLAG_SEED | SUBMIT_FLAG_MEMORY_OFF | SUBMIT_FLAG_RAW | SUBMIT_FLAG_TOOLS
                | SUBMIT_TOOL_FORMAT | SUBMIT_FLAG_KEEP_ALIVE | SUBMIT_FLAG_DRY
                | SUBMIT_DRY_ONLY),
    Op.CANCEL: CANCEL_FLAG_ADMIN, Op.READ: READ_FLAG_ANNOTATIONS, Op.WAIT: READ_FLAG_ANNOTATIONS,
    Op.MEDIA_PUT: MEDIA_FLAG_FINAL | MEDIA_FLAG_ABORT | MEDIA_FLAG_EPHEMERAL}
_ZERO = Header(magic=0, version=0)
_UNUSED: dict[int, list[int]] = {op: [i for i, name in enumerate(Header._fields) if name not in (
    "magic", "version", "op", "tag", "payload_length", *used)] for op, used in REQUEST_FIELDS.items()}
_UNUSED_GET: dict[int, tuple[Any, tuple[Any, ...]]] = {
    op: (operator.itemgetter(*idx), tuple(_ZERO[i] for i in idx)) for op, idx in _UNUSED.items()}


def check_request(h: Header) -> None:
    """Refuse (WireError 400, NONZERO_FIELD) a request that sets a field its operation
    does not use, a flag bit it does not define, or a SUBMIT seed or keep-alive without
    its flag."""
    get, zeros = _UNUSED_GET[h.op]  # (an int key finds the Op's entry: no enum built)
    if get(h) != zeros:
        i = next(i for i in _UNUSED[h.op] if h[i] != _ZERO[i])
        name, row = HEADER_FIELDS[i]
        raise WireError(f"{name} is not zero in a {Op(h.op).name} request", 400,
                        Reason.NONZERO_FIELD, row.offset)
    if h.flags & ~REQUEST_FLAGS.get(h.op, 0):
        raise WireError(f"unknown flag bits {h.flags:#x} in a {Op(h.op).name} request", 400,
                        Reason.NONZERO_FIELD, 116)
    if h.op == Op.SUBMIT and h.value and not h.flags & SUBMIT_FLAG_SEED:
        raise WireError("a seed without SUBMIT_FLAG_SEED", 400, Reason.NONZERO_FIELD, 120)
    if h.op == Op.SUBMIT and h.flags & SUBMIT_DRY_ONLY and not h.flags & SUBMIT_FLAG_DRY:
        raise WireError("a dry run's flag without SUBMIT_FLAG_DRY", 400, Reason.NONZERO_FIELD,
                        116)
    if h.op == Op.SUBMIT and h.cursor and not h.flags & SUBMIT_FLAG_KEEP_ALIVE:
        raise WireError("a keep-alive without SUBMIT_FLAG_KEEP_ALIVE", 400,
                        Reason.NONZERO_FIELD, 64)
