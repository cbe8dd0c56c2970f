"""The aotx broker wire protocol: a sans-I/O codec, read top to bottom.

Every packet between the gateway, the broker and the device is at most ``MAX_PACKET``
(65536) bytes: a 128-byte little-endian header, then ``payload_length`` payload bytes.
The same header serves requests (gateway -> device) and replies; the fields an
operation's request does not use are zero (``check_request``).  Each fixed layout (the
header, the information head and rows, grant rows, media metadata, the policy status,
telemetry) is one table: a NamedTuple whose fields carry their rows (format, offset,
who fixed it, meaning); the ``struct``, the codec and the tables of docs/protocol.md
come from those rows.  The seed (``shared/seeds``) fixes the offsets marked so.

Nothing here does I/O.  Decoders take ``bytes``/``memoryview`` and return a value or
raise :class:`WireError`, whose status and :class:`Reason` are what to answer with.
"""

from __future__ import annotations

import enum
import operator
import struct
from collections.abc import Sequence
from typing import Annotated, Any, Generic, NamedTuple, TypeVar, get_type_hints

MAGIC = 0x58544F41  # b"AOTX" read little endian
VERSION = 1
MAX_PACKET = 65536
HEADER_SIZE = 128
MAX_PAYLOAD = MAX_PACKET - HEADER_SIZE
DIGEST_SIZE = 32
IDENTITY_SIZE = 16
ZERO_IDENTITY = bytes(IDENTITY_SIZE)
T = TypeVar("T")


class Op(enum.IntEnum):
    """Operation codes (header offset 6)."""

    INFO = 1  #: Read the information payload (models and limits).
    SUBMIT = 2  #: Admit a request (submission payload).
    READ = 3  #: Read one output window of a request at ``cursor``.
    CANCEL = 4  #: Request cancellation of a request by identity.
    GRANT_INSTALL = 5  #: Install grant rows (row count at offset 76).
    GRANT_READ = 6  #: Read installed grant rows.
    WAIT = 7  #: Wait until a request has bytes past ``cursor`` or changes state.
    MEDIA_PUT = 8  #: Media source upload chunk.
    MEDIA_LIST = 9  #: Media list page (80-byte rows).
    SHARED_SAVE = 10  #: Shared conversation operations (reserved by the seed, not provided).
    SHARED_LOAD = 11
    POLICY = 12  #: Resident policy read/control.
    TELEMETRY = 13  #: Telemetry sample.
    MEDIA_READ = 14  #: Media source read (metadata) and removal.
    MEDIA_DELETE = 15
    METRICS = 16  #: Device counters for /metrics (payload: UTF-8 JSON; not a hot path).
    BROKER_STATS = 17  #: Broker counters, answered by the broker itself (payload: UTF-8 JSON).
    MEMORY = 18  #: The caller's automatic memory (sub-operation at offset 72, payload UTF-8 JSON).
    UNPARK = 19  #: Answer the caller's WAITs on a request, or its EMBED (withdrawn), now: the caller left.
    EMBED = 20  #: Embed inputs (payload: encode_embed) with a model (role): unit float32 vectors.
    WAITS = 21  #: Several WAITs in one packet, answered together (encode_waits; protocol.md 10.1).


class MemoryOp(enum.IntEnum):
    """Sub-operations of Op.MEMORY (``memory_op``; approve and reject name ``pending_id``)."""

    READ = 1
    ERASE = 2
    PENDING = 3
    APPROVE = 4
    REJECT = 5


class Phase(enum.IntEnum):
    """Request phases, in the seed's order.  Anything >= COMPLETED is terminal."""

    FREE = 0
    QUEUED = 1
    PREPARING = 2
    RUNNING = 3
    COMPLETED = 4
    FAILED = 5
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        return self >= Phase.COMPLETED


class Finish(enum.IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2


class Role(enum.IntEnum):
    """Message roles in submission payloads."""

    SYSTEM = 0
    USER = 1
    ASSISTANT = 2
    TOOL = 3  # ours: a tool's result, with a FIELDS part naming its tool_call_id


class ToolFormat(enum.IntEnum):
    """How a model's chat template writes tool calls (its information row; a SUBMIT's
    flags bits 4-5 name the one the request's output follows)."""

    FALLBACK = 0  #: the template knows no tools: the gateway writes them as text (Hermes)
    HERMES = 1  #: the template renders tools; a call is ``<tool_call>`` JSON ``</tool_call>``
    LLAMA3 = 2  #: the template renders tools; a call is one JSON ``{"name", "parameters"}``


class PartKind(enum.IntEnum):
    TEXT = 0
    IMAGE_DIGEST = 1
    AUDIO_DIGEST = 2
    TOKENS = 3  # ours: u32 token ids, only in a raw prompt (SUBMIT_FLAG_RAW)
    FIELDS = 4  # ours: a JSON object of template fields (tool_calls, tool_call_id), one a message


class Action(enum.IntFlag):
    """Grant action bits.  POLICY_READ (8) and POLICY_CONTROL (128) are the seed's."""

    SUBMIT = 1
    READ = 2
    CANCEL = 4
    POLICY_READ = 8
    TELEMETRY = 16
    MEDIA = 32
    ADMIN = 64
    POLICY_CONTROL = 128

    @classmethod
    def all(cls) -> Action:
        return cls(255)


#: Header flags for MEDIA_PUT (offset 116).
MEDIA_FLAG_FINAL = 1  # the last chunk: assemble, hash and check the source
MEDIA_FLAG_ABORT = 2  # drop the upload in progress
MEDIA_FLAG_EPHEMERAL = 4  # a request's inline media: removed when its last lease ends
MEDIA_LIST_MAX_ROWS = MAX_PACKET // 80 - 2  # 817 rows fit one reply

#: What the media decoders take (the device refuses the rest before decoding).
MAX_IMAGE_PIXELS = 16 * 1024 * 1024  # decoded at 3 bytes a pixel: 48 MiB at most
AUDIO_RATES = (8000, 384000)  # sample rates (Hz); a header may claim 1 Hz and grow 16000-fold
MAX_AUDIO_SECONDS = 600  # decoded as float32 at the projector's rate

#: Header flags for SUBMIT (offset 116).
SUBMIT_FLAG_SEED = 1  # the seed field at 120 is meaningful
SUBMIT_FLAG_MEMORY_OFF = 2  # the request opts out of automatic memory
SUBMIT_FLAG_RAW = 4  # one message of one part, the prompt itself: no chat template
SUBMIT_FLAG_TOOLS = 8  # the output is tool calls' format: kept, and in every state reply
SUBMIT_TOOL_FORMAT_SHIFT = 4  # bits 4-5: the ToolFormat of the calls (kept with the flag above)
SUBMIT_TOOL_FORMAT = 3 << SUBMIT_TOOL_FORMAT_SHIFT
CANCEL_FLAG_ADMIN = 1  # cancel any principal's request (needs Action.ADMIN)
READ_FLAG_ANNOTATIONS = 1  # READ/WAIT: the request's annotation stream, not its output


class Reason(enum.IntEnum):
    """Why a reply refuses, a request failed (codes from 60) or a source was refused: offset
    28 of a reply.  No text crosses the wire: the gateway words the code (gateway/errors.py)
    with the number at offset 120 (``detail``) that a member names."""

    NONE = 0
    MALFORMED = 1  #: the codec refused a header or payload (a peer's bug; the receiver logs which)
    VERSION = 2  #: the header's version is not ``VERSION`` (505)
    TOO_LARGE = 3  #: the packet or a payload does not fit ``MAX_PACKET`` (413)
    NONZERO_FIELD = 4  #: a field this operation does not use is not zero; detail: its header offset
    NOT_SUPPORTED = 5  #: the operation is not provided here (501), as ops 10 and 11
    NO_MAILBOX = 6  #: the broker has no free mailbox (503)
    INTERNAL = 7  #: the device failed (500); its log says why
    NO_GRANT = 10  #: no grant row is installed for the principal
    ACTION = 11  #: the grant lacks an action; detail: the action bit(s) needed
    NO_MODEL = 12  #: no such model role, or not in the grant's model mask
    NO_REQUEST = 13  #: unknown, foreign, reclaimed or revoked-revision request
    EPOCH_ENDED = 14  #: the handle's runtime epoch has ended (410)
    EPOCH_MISMATCH = 15  #: a mutation's frame epoch is not the device's
    CURSOR = 16  #: the cursor (offset 64) is past the bytes produced (offset 76)
    INPUT_BYTES = 20  #: the submission is larger than the grant allows; detail: the grant's bytes
    PROMPT_LENGTH = 21  #: the prompt (offset 80 tokens) leaves no room; detail: the most the model takes
    OUTPUT_TOKENS = 22  #: max_tokens is over the limit; detail: the limit
    DEVICE_BUSY = 23  #: the device holds its maximum of active requests (429)
    ACTIVE_LIMIT = 24  #: the principal holds the grant's active requests; detail: that limit (429)
    RATE_LIMIT = 25  #: the principal used its admissions a minute; detail: that rate (429)
    TEMPLATE = 26  #: the model's chat template refused the messages (raise_exception)
    TEMPLATE_FAILED = 27  #: the chat template failed, or ran past its time or output bounds
    MODALITY = 28  #: the model takes no such input; detail: the PartKind
    NO_SOURCE = 29  #: a digest names no ready source of the principal; detail: the media part's index
    NO_PROJECTOR = 30  #: the model has no projector for media input
    IMAGE_UNREADABLE = 31  #: media part (detail) is an image the decoder cannot read
    IMAGE_PIXELS = 32  #: media part (detail) is an image of more than ``MAX_IMAGE_PIXELS``
    AUDIO_UNREADABLE = 33  #: media part (detail) is audio the decoder cannot read
    AUDIO_RATE = 34  #: media part (detail) has a sample rate outside ``AUDIO_RATES``
    AUDIO_LENGTH = 35  #: media part (detail) lasts longer than ``MAX_AUDIO_SECONDS``, or does not say
    MEDIA_LAST = 36  #: the prompt must end with text after its last media part
    MEDIA_PREPARE = 37  #: the projector could not preprocess the media
    SPECIAL_TEXT = 38  #: a message's text holds special-token text the chat template changes; detail: the message
    LOGIT_BIAS = 39  #: a logit-bias token id is not in the model's vocabulary; detail: that id
    NO_SOURCE_ID = 40  #: no such source of the principal
    UPLOAD_OFFSET = 41  #: no upload in progress at that offset, or the chunk does not follow the last
    CONTENT_TYPE = 42  #: unknown content type code (415)
    SOURCE_COUNT = 43  #: the grant's media sources are all used; detail: that count
    SOURCE_BYTES = 44  #: the source exceeds the bytes allowed; detail: those bytes
    LEASED = 45  #: the source is leased by requests; detail: how many
    EMPTY = 46  #: a refused source: it is empty
    MAGIC = 47  #: a refused source: its bytes are not its declared content type
    MEDIA_SHARE = 48  #: the principal's sources would pass its share of media bytes; detail: it
    MEDIA_POOL = 49  #: the device's media pool (all principals' sources) is full (507)
    POLICY_OFF = 50  #: the resident policy is off (no qualified model)
    STALE_REVISION = 51  #: the control revision is stale; the 160-byte status says the current one
    NO_DECISION = 52  #: no such pending memory decision
    MEMORY_OP = 53  #: unknown memory sub-operation
    GRAMMAR = 54  #: the constraint cannot be compiled or enforced; payload: UTF-8 JSON, why
    PROMPT_TOKEN = 55  #: a raw prompt's token id is not in the model's vocabulary; detail: it
    TOOL_FORMAT = 56  #: the tools' fields or format are not the model's template's; detail: its ToolFormat
    TOOL_TEXT = 57  #: a tool, call or call id holds special-token text; detail: the message (count: the tools)
    ENGINE_FEATURE = 58  #: the model's engine does not provide it (501); detail: an EngineFeature
    KV_FULL = 60  #: the engine ran out of KV cache (503)
    DECODE = 61  #: llama_decode failed (500)
    MEDIA_ENCODE = 62  #: encoding a media part failed (500)
    GRAMMAR_FAILED = 63  #: the constraint's matcher failed while generating (500)
    WITHDRAWN = 64  #: an EMBED call was withdrawn: its ``wait_ms`` ran out, or its caller sent UNPARK (503)
    TOKEN_ID = 70  #: an EMBED input (its index at offset 64) holds a token id outside the vocabulary; detail: the id


class WireError(Exception):
    """A packet or payload that cannot be accepted: the peer gets ``status`` and ``reason``
    (and ``detail``); ``message`` stays in this process's log."""

    def __init__(self, message: str, status: int = 400, reason: Reason = Reason.MALFORMED,
                 detail: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason
        self.detail = detail


def _check_enum(enum_type: type[enum.IntEnum], value: int, what: str) -> None:
    # A dict lookup, not enum_type(value): an enum costs microseconds, on every packet.
    if value not in enum_type._value2member_map_:
        raise WireError(f"unknown {what} {value}")


# -- Layouts, the 128-byte header first


class F(NamedTuple):
    """One field's row of a layout table, carried by its annotation: a layout is described
    once, and its ``struct``, its codec and its table in docs/protocol.md come from it."""

    fmt: str  #: struct format character(s)
    offset: int
    seed: bool  #: the seed fixes this offset
    meaning: str


class _View(Generic[T]):
    """A named accessor: one meaning of a field that means different things per operation
    (``when`` says which; the header table in docs/protocol.md lists them)."""

    def __init__(self, field: str, when: str) -> None:
        self.field, self.when = field, when

    def __get__(self, header: _Fields, owner: object = None) -> T:
        return getattr(header, self.field)


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
    wait_ms = _View[int]("limit", "WAIT: timeout; EMBED: how long its caller waits")
    max_rows = _View[int]("limit", "MEDIA_LIST")
    retry_after = _View[int]("limit", "429 reply: seconds")
    submit_flags = _View[int]("flags", "SUBMIT: SUBMIT_FLAG_*; a state reply: the kept ones")
    cancel_flags = _View[int]("flags", "CANCEL: CANCEL_FLAG_*")
    media_flags = _View[int]("flags", "MEDIA_PUT: MEDIA_FLAG_*")
    seed = _View[int]("value", "SUBMIT, with SUBMIT_FLAG_SEED")
    detail = _View[int]("value", "refusal: the number its reason names")

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


def layout(record: type[tuple[Any, ...]], size: int) -> struct.Struct:
    """The ``struct`` of a record annotated with rows (``F``): offsets checked, ``size`` bytes."""
    at = 0
    for name, row in rows(record):
        if row.offset != at:
            raise AssertionError(f"{record.__name__}.{name} is at {at}, its row says {row.offset}")
        at += struct.calcsize("<" + row.fmt)
    packed = struct.Struct("<" + "".join(row.fmt for _, row in rows(record)))
    if packed.size != size:
        raise AssertionError(f"{record.__name__} is {packed.size} bytes, not {size}")
    return packed


def rows(record: type[tuple[Any, ...]]) -> tuple[tuple[str, F], ...]:
    """(field name, its row) of a record annotated with rows, in offset order."""
    hints = get_type_hints(record, include_extras=True)
    return tuple((name, hints[name].__metadata__[0]) for name in record._fields  # type: ignore[attr-defined]
                 if hasattr(hints[name], "__metadata__"))


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
    Op.SUBMIT: ("principal", "role", "limit", "temperature", "top_p", "flags", "value"),
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
    Op.WAITS: ("total",),
}
#: The flag bits each operation defines; other bits are unused, so zero.
REQUEST_FLAGS: dict[int, int] = {
    Op.SUBMIT: (SUBMIT_FLAG_SEED | SUBMIT_FLAG_MEMORY_OFF | SUBMIT_FLAG_RAW | SUBMIT_FLAG_TOOLS
                | SUBMIT_TOOL_FORMAT),
    Op.CANCEL: CANCEL_FLAG_ADMIN, Op.READ: READ_FLAG_ANNOTATIONS, Op.WAIT: READ_FLAG_ANNOTATIONS,
    Op.MEDIA_PUT: MEDIA_FLAG_FINAL | MEDIA_FLAG_ABORT | MEDIA_FLAG_EPHEMERAL}
_ZERO = Header(magic=0, version=0)
_UNUSED: dict[int, list[int]] = {op: [i for i, name in enumerate(Header._fields) if name not in (
    "magic", "version", "op", "tag", "payload_length", *used)] for op, used in REQUEST_FIELDS.items()}
_UNUSED_GET: dict[int, tuple[Any, tuple[Any, ...]]] = {
    op: (operator.itemgetter(*idx), tuple(_ZERO[i] for i in idx)) for op, idx in _UNUSED.items()}


def check_request(h: Header) -> None:
    """Refuse (WireError 400, NONZERO_FIELD) a request that sets a field its operation
    does not use, a flag bit it does not define, or a SUBMIT seed without its flag."""
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


MAX_CONSTRAINT_BYTES = 64 * 1024  # a constraint's canonical text (the engine's limit)
MAX_SCHEMA_DEPTH = 32  # nested schema objects


class Constraint(NamedTuple):
    kind: GrammarKind
    text: str


class Submission(NamedTuple):
    messages: tuple[Message, ...]
    stop: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    constraint: Constraint | None = None
    tools: bytes = b""  #: UTF-8 JSON array: the tools the chat template renders (none: empty)


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
    constraint = sub.constraint or (Constraint(GrammarKind.NONE, "") if sub.tools else None)
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
    if sub.tools:
        _json_text(sub.tools, "tools", b"[")
        out += _U32.pack(len(sub.tools)) + sub.tools
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
        _json_text(tools, "tools", b"[")
    if r.pos != len(r.data):
        raise WireError(f"{len(r.data) - r.pos} trailing bytes after the payload")
    return Submission(tuple(messages), tuple(stops), sampling, constraint, tools)


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


# -- Information payload: a 192-byte head, ``model_count`` 40-byte rows, then a string
# area (aliases and digests) that rows point into, by offset from its start.

MOD_TEXT, MOD_IMAGE, MOD_AUDIO = 1, 2, 4
MODALITY_BITS = {"text": MOD_TEXT, "image": MOD_IMAGE, "audio": MOD_AUDIO}
PART_MODALITY = {PartKind.IMAGE_DIGEST: "image", PartKind.AUDIO_DIGEST: "audio"}  # media parts


def _tool_format(value: int) -> ToolFormat:
    _check_enum(ToolFormat, value, "tool format")
    return ToolFormat(value)


def submit_tool_format(flags: int) -> ToolFormat:
    """The ToolFormat a SUBMIT's (or a state reply's kept) flags name."""
    return _tool_format((flags & SUBMIT_TOOL_FORMAT) >> SUBMIT_TOOL_FORMAT_SHIFT)


def modality_names(mods: int) -> list[str]:
    """The names of the modality bits set in ``mods``, in bit order."""
    return [name for name, bit in MODALITY_BITS.items() if mods & bit]


class ModelInfo(NamedTuple):
    role: int
    alias: str
    sha256: bytes
    modalities: int
    published_at: int
    context_tokens: int
    automatic_memory: bool = False
    embedding_dims: int = 0  # EMBED: floats per vector; 0: the model does not embed
    embedding_tokens: int = 0  # EMBED: the most tokens of one input
    tool_format: ToolFormat = ToolFormat.FALLBACK  # how its chat template writes tool calls


class ModelRow(NamedTuple):
    role: Annotated[int, F("I", 0, False, "model role, 0..31")]
    modalities: Annotated[int, F("H", 4, False, "input modality bits: 1 text, 2 image, 4 audio")]
    tool_format: Annotated[int, F("H", 6, False, "ToolFormat: how its template writes calls")]
    published_at: Annotated[int, F("Q", 8, False, "unix seconds")]
    context_tokens: Annotated[int, F("I", 16, False, "KV cells per sequence")]
    alias_offset: Annotated[int, F("I", 20, False, "in the string area")]
    alias_length: Annotated[int, F("I", 24, False, "UTF-8 bytes")]
    digest_offset: Annotated[int, F("I", 28, False, "32 bytes of SHA-256, in the string area")]
    embedding_dims: Annotated[int, F("I", 32, False, "EMBED: floats per vector (0: no embeddings)")] = 0
    embedding_tokens: Annotated[int, F("I", 36, False, "EMBED: the most tokens of one input")] = 0


class Info(NamedTuple):
    """The information payload: the 192-byte head (the seed's), then ``models``' rows."""

    schema: Annotated[int, F("I", 0, False, "1")] = 1
    abi: Annotated[int, F("I", 4, False, "1")] = 1
    epoch: Annotated[int, F("Q", 8, False, "runtime epoch")] = 0
    model_count: Annotated[int, F("I", 16, False, "rows that follow")] = 0
    max_packet: Annotated[int, F("I", 20, False, "MAX_PACKET")] = MAX_PACKET
    max_payload: Annotated[int, F("I", 24, False, "MAX_PAYLOAD")] = MAX_PAYLOAD
    window_bytes: Annotated[int, F("I", 28, False, "largest output window")] = 0
    context_tokens: Annotated[int, F("I", 32, False, "the first model's context")] = 0
    output_tokens: Annotated[int, F("I", 36, False, "output tokens a request may ask")] = 0
    active_requests: Annotated[int, F("I", 40, False, "queued + running, device-wide")] = 0
    slots: Annotated[int, F("I", 44, False, "sequences decoded together, all models")] = 0
    media_bytes: Annotated[int, F("Q", 48, False, "largest media source")] = 0
    retention_seconds: Annotated[int, F("I", 56, False, "terminal results kept")] = 0
    retention_requests: Annotated[int, F("I", 60, False, "terminal results kept, at most")] = 0
    mailboxes: Annotated[int, F("I", 64, False, "mapped mailboxes")] = 0
    kv_cells: Annotated[int, F("I", 68, False, "KV cells, all models")] = 0
    started_unix_ns: Annotated[int, F("Q", 72, False, "when the epoch started")] = 0
    reserved_80: Annotated[bytes, F("76s", 80, True, "zero")] = bytes(76)
    memory_roles: Annotated[int, F("I", 156, True, "bit r: role r qualified")] = 0
    reserved_160: Annotated[bytes, F("32s", 160, True, "zero")] = bytes(32)
    models: tuple[ModelInfo, ...] = ()


INFO_HEADER, INFO_ROW = layout(Info, 192), layout(ModelRow, 40)


def encode_info(info: Info) -> bytes:
    strings, table, roles = bytearray(), bytearray(), 0
    for m in info.models:
        if not 0 <= m.role < 32:
            raise WireError(f"model role {m.role} outside 0..31")
        if len(m.sha256) != DIGEST_SIZE:
            raise WireError("model digest must be 32 bytes")
        alias = m.alias.encode("utf-8")
        row = ModelRow(m.role, m.modalities, int(m.tool_format), m.published_at,
                       m.context_tokens, len(strings), len(alias), len(strings) + len(alias),
                       m.embedding_dims, m.embedding_tokens)
        strings += alias + m.sha256
        table += INFO_ROW.pack(*row)
        roles |= int(m.automatic_memory) << m.role
    head = info._replace(model_count=len(info.models), memory_roles=roles)
    return INFO_HEADER.pack(*head[:-1]) + bytes(table) + bytes(strings)  # all but models


def decode_info(data: bytes | memoryview) -> Info:
    data = bytes(data)
    if len(data) < INFO_HEADER.size:
        raise WireError("information payload shorter than its 192-byte header")
    info = Info._make((*INFO_HEADER.unpack_from(data), ()))
    if info.schema != 1 or info.abi != 1:
        raise WireError(f"unsupported information schema {info.schema}/{info.abi}")
    if any(info.reserved_80) or any(info.reserved_160):
        raise WireError("reserved information header bytes are not zero")
    rows_end = INFO_HEADER.size + info.model_count * INFO_ROW.size
    if rows_end > len(data):
        raise WireError(f"model count {info.model_count} overruns the payload")
    strings, models, visible = data[rows_end:], [], 0
    for i in range(info.model_count):
        r = ModelRow._make(INFO_ROW.unpack_from(data, INFO_HEADER.size + i * INFO_ROW.size))
        if r.role >= 32 or visible >> r.role & 1:
            raise WireError(f"bad or repeated model role {r.role}")
        visible |= 1 << r.role
        raw, digest = (strings[r.alias_offset:r.alias_offset + r.alias_length],
                       strings[r.digest_offset:r.digest_offset + DIGEST_SIZE])
        if len(raw) != r.alias_length or len(digest) != DIGEST_SIZE:
            raise WireError("model row string offsets overrun the payload")
        try:
            alias = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("model alias is not valid UTF-8") from None
        models.append(ModelInfo(r.role, alias, digest, r.modalities, r.published_at,
                                r.context_tokens, bool(info.memory_roles >> r.role & 1),
                                r.embedding_dims, r.embedding_tokens, _tool_format(r.tool_format)))
    if info.memory_roles & ~visible:
        raise WireError("automatic-memory bits set for roles that are not visible")
    return info._replace(models=tuple(models))


# -- Grant rows: 64 bytes each, the header's ``total`` (row_count) holds how many.  A
# limit of 0 means the device's own.

GRANT_FLAG_MEMORY = 1


class Grant(NamedTuple):
    principal: Annotated[int, F("I", 0, False, "principal id (0 is reserved)")] = 0
    flags: Annotated[int, F("I", 4, False, "bit 0 (GRANT_FLAG_MEMORY): automatic memory on")] = 0
    revision: Annotated[int, F("Q", 8, False, "assigned by the device on install; 0 to install")] = 0
    actions: Annotated[int, F("I", 16, False, "`Action` bits")] = 0
    reserved_20: Annotated[int, F("I", 20, False, "zero")] = 0
    model_mask: Annotated[int, F("Q", 24, False, "bit r: model role r")] = 0
    max_active: Annotated[int, F("I", 32, False, "queued + running requests")] = 0
    max_output_tokens: Annotated[int, F("I", 36, False, "output tokens per request")] = 0
    max_input_bytes: Annotated[int, F("I", 40, False, "submission bytes per request")] = 0
    max_media_sources: Annotated[int, F("I", 44, False, "media sources held")] = 0
    max_media_bytes: Annotated[int, F("Q", 48, False, "media bytes held")] = 0
    rate_per_minute: Annotated[int, F("I", 56, False, "admissions a minute (0: unlimited)")] = 0
    reserved_60: Annotated[int, F("I", 60, False, "zero")] = 0


GRANT_ROW = layout(Grant, 64)
#: Rows in a GRANT_INSTALL, or a GRANT_READ reply (a full page: ask from the next principal).
GRANT_PAGE = 1000


def encode_grants(grants: list[Grant] | tuple[Grant, ...]) -> bytes:
    if len(grants) * GRANT_ROW.size > MAX_PAYLOAD:
        raise WireError("too many grant rows for one packet", 413, Reason.TOO_LARGE)
    try:
        return b"".join(GRANT_ROW.pack(*g) for g in grants)
    except struct.error as exc:
        raise WireError(f"grant field out of range: {exc}") from None


def decode_grants(data: bytes | memoryview, count: int) -> list[Grant]:
    if len(data) != count * GRANT_ROW.size:
        raise WireError(f"{count} grant rows need {count * GRANT_ROW.size} bytes, got {len(data)}")
    out = [Grant._make(GRANT_ROW.unpack_from(data, i * GRANT_ROW.size)) for i in range(count)]
    for g in out:
        if g.reserved_20 or g.reserved_60:
            raise WireError("reserved grant row bytes are not zero")
        if g.actions & ~0xFF:
            raise WireError(f"unknown action bits {g.actions & ~0xFF:#x}")
        if g.flags & ~GRANT_FLAG_MEMORY:
            raise WireError("unknown grant flags")
        if g.principal == 0:
            raise WireError("principal 0 is reserved")
    return out


# -- Media list rows: 80 bytes = 16-byte source id + the 64-byte media-read metadata
# (MEDIA_READ's and MEDIA_PUT's reply payload).

MEDIA_ROW_SIZE = 80


class MediaState(enum.IntEnum):
    RECEIVING = 1
    READY = 2
    REFUSED = 3


#: Content type codes carried in media metadata (1-15 images, 16-31 audio).
MEDIA_TYPES: dict[int, str] = {
    1: "image/png", 2: "image/jpeg", 3: "image/webp", 4: "image/gif",
    16: "audio/wav", 17: "audio/mpeg", 18: "audio/flac", 19: "audio/ogg",
}


def media_kind(content_type: int) -> PartKind:
    """The part kind that names a source of this content type code."""
    return PartKind.IMAGE_DIGEST if content_type < 16 else PartKind.AUDIO_DIGEST


class MediaMeta(NamedTuple):
    digest: Annotated[bytes, F("32s", 0, False, "SHA-256 of the bytes")]
    size: Annotated[int, F("Q", 32, False, "byte count")]
    kind: Annotated[PartKind, F("I", 40, False, "`PartKind`: 1 image, 2 audio")]
    state: Annotated[MediaState, F("I", 44, False, "`MediaState`")]
    leases: Annotated[int, F("I", 48, False, "requests holding it")]
    content_type: Annotated[int, F("I", 52, False, "code in `MEDIA_TYPES`")]
    created_ms: Annotated[int, F("Q", 56, False, "unix milliseconds")]


MEDIA_META = layout(MediaMeta, 64)


def decode_media_meta(data: bytes | memoryview) -> MediaMeta:
    if len(data) != MEDIA_META.size:
        raise WireError("media metadata must be 64 bytes")
    m = MediaMeta._make(MEDIA_META.unpack_from(data))
    _check_enum(PartKind, m.kind, "media kind")
    if m.kind not in PART_MODALITY:
        raise WireError("media kind must be image or audio")
    _check_enum(MediaState, m.state, "media state")
    if m.content_type not in MEDIA_TYPES:
        raise WireError(f"unknown content type code {m.content_type}")
    return m._replace(digest=bytes(m.digest), kind=PartKind(m.kind), state=MediaState(m.state))


def encode_media_rows(rows: list[tuple[bytes, MediaMeta]]) -> bytes:
    out = bytearray()
    for source_id, meta in rows:
        if len(source_id) != IDENTITY_SIZE:
            raise WireError("source id must be 16 bytes")
        out += source_id + encode_media_meta(meta)
    return bytes(out)


def decode_media_rows(data: bytes | memoryview) -> list[tuple[bytes, MediaMeta]]:
    if len(data) % MEDIA_ROW_SIZE:
        raise WireError(f"media list payload of {len(data)} bytes is not whole 80-byte rows")
    data = bytes(data)
    return [(data[i:i + 16], decode_media_meta(data[i + 16:i + MEDIA_ROW_SIZE]))
            for i in range(0, len(data), MEDIA_ROW_SIZE)]


# -- Policy (operation 12): a 16-byte control payload; the 160-byte status reply.

class PolicyAction(enum.IntEnum):
    PAUSE = 1
    RESUME = 2
    STOP = 3
    REVIEW_ON = 4
    REVIEW_OFF = 5


class PolicyState(enum.IntEnum):
    OFF = 0
    QUIET = 1
    ACTIVE = 2
    PAUSED = 3
    STOPPED = 4
    ERROR = 5
    RECORDING = 6


class PolicyReason(enum.IntEnum):
    QUIET = 0
    FOREGROUND = 1
    PAUSED = 2
    CAPACITY = 3
    ACTIVE = 4
    DISABLED = 5


class PolicyControl(NamedTuple):
    schema: Annotated[int, F("I", 0, True, "1")] = 1
    action: Annotated[PolicyAction, F("I", 4, True, "`PolicyAction`")] = PolicyAction.PAUSE
    expected_revision: Annotated[int, F("Q", 8, True, "the control revision it expects")] = 0


POLICY_CONTROL = layout(PolicyControl, 16)


def decode_policy_control(data: bytes | memoryview) -> PolicyControl:
    if len(data) != POLICY_CONTROL.size:
        raise WireError("policy control payload must be 16 bytes")
    c = PolicyControl._make(POLICY_CONTROL.unpack_from(data))
    if c.schema != 1:
        raise WireError(f"unsupported policy control schema {c.schema}")
    _check_enum(PolicyAction, c.action, "policy action")
    return c._replace(action=PolicyAction(c.action))


class PolicyStatus(NamedTuple):
    """The seed's 160-byte status: 8 u32, 11 u64 from byte 32, the reason at 120, zeros."""

    schema: Annotated[int, F("I", 0, True, "1")] = 1
    abi: Annotated[int, F("I", 4, True, "1")] = 1
    mode: Annotated[int, F("I", 8, True, "1: automatic memory")] = 0
    state: Annotated[PolicyState, F("I", 12, True, "`PolicyState`")] = PolicyState.OFF
    review_enabled: Annotated[int, F("I", 16, True, "0 or 1")] = 0
    pending: Annotated[int, F("I", 20, True, "decisions waiting for review")] = 0
    active_rows: Annotated[int, F("I", 24, True, "extractions running")] = 0
    result_status: Annotated[int, F("I", 28, True, "HTTP-like status of the last save")] = 0
    control_revision: Annotated[int, F("Q", 32, True, "the next control's expected revision")] = 0
    source_frontier: Annotated[int, F("Q", 40, True, "sources finished with")] = 0
    completed: Annotated[int, F("Q", 48, True, "extractions completed")] = 0
    interrupted: Annotated[int, F("Q", 56, True, "extractions preempted")] = 0
    refused: Annotated[int, F("Q", 64, True, "saves refused (lineage full)")] = 0
    decision: Annotated[int, F("Q", 72, True, "candidate facts decided")] = 0
    saved_generation: Annotated[int, F("Q", 80, True, "generations saved")] = 0
    max_ns: Annotated[int, F("Q", 88, True, "longest extraction")] = 0
    last_ns: Annotated[int, F("Q", 96, True, "last extraction")] = 0
    written_bytes: Annotated[int, F("Q", 104, True, "bytes saved")] = 0
    result_bytes: Annotated[int, F("Q", 112, True, "bytes the extractions produced")] = 0
    reason: Annotated[PolicyReason, F("I", 120, True, "`PolicyReason`")] = PolicyReason.QUIET
    reserved: Annotated[bytes, F("36s", 124, True, "zero")] = bytes(36)


POLICY_STATUS = layout(PolicyStatus, 160)


def decode_policy_status(data: bytes | memoryview) -> PolicyStatus:
    if len(data) != POLICY_STATUS.size:
        raise WireError("policy status must be 160 bytes")
    s = PolicyStatus._make(POLICY_STATUS.unpack_from(data))
    if any(s.reserved):
        raise WireError("policy status bytes 124..159 are not zero")
    _check_enum(PolicyState, s.state, "policy state")
    _check_enum(PolicyReason, s.reason, "policy reason")
    return s._replace(state=PolicyState(s.state), reason=PolicyReason(s.reason))


class Telemetry(NamedTuple):
    """The telemetry payload (operation 13)."""

    allocation_bytes: Annotated[int, F("Q", 0, False, "service allocation bytes")]
    tick: Annotated[int, F("Q", 8, False, "device tick (decode steps)")]
    clock_ns: Annotated[int, F("Q", 16, False, "device clock, this epoch")]
    reserved: Annotated[int, F("Q", 24, False, "zero")] = 0


TELEMETRY = layout(Telemetry, 32)


def pack(record: MediaMeta | PolicyControl | PolicyStatus | Telemetry) -> bytes:
    """A fixed-size payload record as bytes (its layout is its type's)."""
    return _LAYOUTS[type(record)].pack(*record)


encode_media_meta = encode_policy_control = encode_policy_status = encode_telemetry = pack
_LAYOUTS: dict[type, struct.Struct] = {MediaMeta: MEDIA_META, PolicyControl: POLICY_CONTROL,
                                       PolicyStatus: POLICY_STATUS, Telemetry: TELEMETRY}


def decode_telemetry(data: bytes | memoryview) -> Telemetry:
    if len(data) != TELEMETRY.size:
        raise WireError("telemetry payload must be 32 bytes")
    t = Telemetry._make(TELEMETRY.unpack_from(data))
    if t.reserved:
        raise WireError("reserved telemetry bytes are not zero")
    return t


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
