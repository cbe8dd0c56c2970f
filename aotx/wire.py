"""The aotx broker wire protocol: a sans-I/O codec.

Theory of operation
-------------------
Every packet between the gateway, the broker and the device is at most
``MAX_PACKET`` (65536) bytes: a 128-byte little-endian header followed by a
payload of ``header.payload_length`` bytes.  The same header serves requests
(gateway -> device) and replies (device -> gateway); fields that a direction
does not use are zero, and a decoder rejects non-zero reserved bytes.

Offsets fixed by the seed (``shared/seeds``): reply status 8, phase 12,
runtime epoch 40, cursor 64, role 72, total output bytes 76 (grant row count
for grant operations), prompt tokens 80, sampled tokens 84, payload length 88,
finish 92, failure status 96, cancel requested 100.  Everything else is our
choice and is documented in ``docs/protocol.md``; this module is the single
source of truth for both.

Nothing here does I/O.  Decoders take ``bytes``/``memoryview`` and either
return a value or raise :class:`WireError`, whose ``status`` is the protocol
status to answer with.  No other exception escapes a decoder.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

MAGIC = 0x58544F41  # b"AOTX" read little endian
VERSION = 1
MAX_PACKET = 65536
HEADER_SIZE = 128
MAX_PAYLOAD = MAX_PACKET - HEADER_SIZE
DIGEST_SIZE = 32
IDENTITY_SIZE = 16


class WireError(Exception):
    """A packet or payload that cannot be accepted.

    ``status`` is the HTTP-like protocol status the peer should receive
    (400 for malformed input, 413 for oversize, 505 for a version mismatch).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Op(enum.IntEnum):
    """Operation codes (header offset 6)."""

    #: Read the information payload (models and limits).
    INFO = 1
    #: Admit a request (submission payload).
    SUBMIT = 2
    #: Read one output window of a request at ``cursor``.
    READ = 3
    #: Request cancellation of a request by identity.
    CANCEL = 4
    #: Install grant rows (row count at offset 76).
    GRANT_INSTALL = 5
    #: Read installed grant rows.
    GRANT_READ = 6
    #: Wait until a request has bytes past ``cursor`` or changes state.
    WAIT = 7
    #: Media source upload chunk.
    MEDIA_PUT = 8
    #: Media list page (80-byte rows).
    MEDIA_LIST = 9
    #: Shared conversation operations (reserved by the seed, not provided).
    SHARED_SAVE = 10
    SHARED_LOAD = 11
    #: Resident policy read/control.
    POLICY = 12
    #: Telemetry sample.
    TELEMETRY = 13
    #: Media source read (metadata) and removal.
    MEDIA_READ = 14
    MEDIA_DELETE = 15
    #: Device counters for /metrics (payload: UTF-8 JSON; not a hot path).
    METRICS = 16
    #: Broker counters, answered by the broker itself (payload: UTF-8 JSON).
    BROKER_STATS = 17
    #: The caller's automatic memory (sub-operation at offset 72, payload UTF-8 JSON).
    MEMORY = 18


class MemoryOp(enum.IntEnum):
    """Sub-operations of Op.MEMORY (header offset 72)."""

    READ = 1
    ERASE = 2
    PENDING = 3
    APPROVE = 4  # pending decision id at offset 64
    REJECT = 5  # pending decision id at offset 64


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


class PartKind(enum.IntEnum):
    TEXT = 0
    IMAGE_DIGEST = 1
    AUDIO_DIGEST = 2


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

#: Header flags for SUBMIT (offset 116).
SUBMIT_FLAG_SEED = 1  # the seed field at 120 is meaningful
SUBMIT_FLAG_MEMORY_OFF = 2  # the request opts out of automatic memory


def _check_enum(enum_type: type[enum.IntEnum], value: int, what: str) -> None:
    # A dict lookup, not enum_type(value): constructing an enum costs microseconds,
    # and every packet's header is checked in the gateway, the broker and the device.
    if value not in enum_type._value2member_map_:
        raise WireError(f"unknown {what} {value}")


# --------------------------------------------------------------------------
# The 128-byte header
#
#   off size field                 notes
#     0   4  magic                 0x58544F41 ("AOTX")
#     4   2  version               1
#     6   2  op                    Op
#     8   4  status                reply: HTTP-like status; request: 0
#    12   4  phase                 reply: Phase of the request
#    16   8  tag                   chosen by the sender of a request, echoed in its reply
#    24   4  principal             principal id, relayed by the gateway
#    28   4  flags                 reserved, zero
#    32   8  revision              reply: grant revision the request was admitted under
#    40   8  epoch                 runtime epoch
#    48  16  identity              request identity (16 bytes) or source id
#    64   8  cursor                byte cursor (request: wanted; reply: the same value)
#    72   4  role                  model role
#    76   4  total                 total output bytes; grant row count for grant ops
#    80   4  prompt_tokens
#    84   4  sampled_tokens
#    88   4  payload_length
#    92   4  finish                Finish
#    96   4  failure               failure status (HTTP-like) of a failed request
#   100   4  cancel_requested      0 or 1
#   104   4  max_tokens            SUBMIT: output token limit; WAIT: timeout ms
#   108   4  temperature           SUBMIT: float32
#   112   4  top_p                 SUBMIT: float32
#   116   4  submit_flags          SUBMIT: SUBMIT_FLAG_*
#   120   8  seed                  SUBMIT: sampling seed when SUBMIT_FLAG_SEED
# --------------------------------------------------------------------------

_HEADER = struct.Struct("<IHHIIQIIQQ16sQIIIIIIIIIffIQ")
assert _HEADER.size == HEADER_SIZE


@dataclass(slots=True)
class Header:
    op: int
    status: int = 0
    phase: int = 0
    tag: int = 0
    principal: int = 0
    flags: int = 0
    revision: int = 0
    epoch: int = 0
    identity: bytes = b"\x00" * IDENTITY_SIZE
    cursor: int = 0
    role: int = 0
    total: int = 0
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    payload_length: int = 0
    finish: int = 0
    failure: int = 0
    cancel_requested: int = 0
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    submit_flags: int = 0
    seed: int = 0
    version: int = VERSION

    def pack(self) -> bytes:
        try:
            return _HEADER.pack(
                MAGIC, self.version, self.op, self.status, self.phase, self.tag,
                self.principal, self.flags, self.revision, self.epoch, self.identity,
                self.cursor, self.role, self.total, self.prompt_tokens,
                self.sampled_tokens, self.payload_length, self.finish, self.failure,
                self.cancel_requested, self.max_tokens, self.temperature, self.top_p,
                self.submit_flags, self.seed,
            )
        except struct.error as exc:
            raise WireError(f"header field out of range: {exc}") from None

    def reply(self, status: int, **fields: object) -> Header:
        """A reply header for this request: same op, tag, principal, epoch, identity, cursor."""
        h = Header(op=self.op, status=status, tag=self.tag, principal=self.principal,
                   epoch=self.epoch, identity=self.identity, cursor=self.cursor)
        for k, v in fields.items():
            setattr(h, k, v)
        return h


def decode_header(data: bytes | memoryview) -> Header:
    if len(data) < HEADER_SIZE:
        raise WireError(f"packet of {len(data)} bytes is shorter than the header")
    (magic, version, op, status, phase, tag, principal, flags, revision, epoch, identity,
     cursor, role, total, prompt_tokens, sampled_tokens, payload_length, finish, failure,
     cancel_requested, max_tokens, temperature, top_p, submit_flags, seed) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("bad magic")
    if version != VERSION:
        raise WireError(f"unsupported protocol version {version}", 505)
    _check_enum(Op, op, "operation")
    _check_enum(Phase, phase, "phase")
    _check_enum(Finish, finish, "finish")
    if flags != 0:
        raise WireError("reserved header flags are not zero")
    if cancel_requested not in (0, 1):
        raise WireError("cancel_requested must be 0 or 1")
    if payload_length > MAX_PAYLOAD:
        raise WireError(f"payload length {payload_length} exceeds {MAX_PAYLOAD}", 413)
    return Header(op=op, status=status, phase=phase, tag=tag, principal=principal, flags=flags,
                  revision=revision, epoch=epoch, identity=bytes(identity), cursor=cursor,
                  role=role, total=total, prompt_tokens=prompt_tokens,
                  sampled_tokens=sampled_tokens, payload_length=payload_length, finish=finish,
                  failure=failure, cancel_requested=cancel_requested, max_tokens=max_tokens,
                  temperature=temperature, top_p=top_p, submit_flags=submit_flags, seed=seed,
                  version=version)


def encode_packet(header: Header, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}", 413)
    header.payload_length = len(payload)
    return header.pack() + payload


def decode_packet(data: bytes | memoryview) -> tuple[Header, bytes]:
    """Split one packet into its header and exact payload."""
    if len(data) > MAX_PACKET:
        raise WireError(f"packet of {len(data)} bytes exceeds {MAX_PACKET}", 413)
    header = decode_header(data)
    end = HEADER_SIZE + header.payload_length
    if len(data) != end:
        raise WireError(
            f"payload length {header.payload_length} disagrees with packet size {len(data)}")
    return header, bytes(data[HEADER_SIZE:end])


# --------------------------------------------------------------------------
# Submission payload
#
#   u32 message_count
#   message_count x { u32 role, u32 part_count,
#                     part_count x { u32 kind, u32 byte_count, bytes[byte_count] } }
#   u32 stop_count                       (our extension: stop strings)
#   stop_count x { u32 byte_count, bytes[byte_count] }   UTF-8, non-empty
# --------------------------------------------------------------------------

MAX_MESSAGES = 4096
MAX_PARTS = 4096
MAX_STOPS = 16
#: Bytes in one stop string (UTF-8).  Output that could still be the start of a
#: stop string is held back and searched on every token, so the length is bounded.
MAX_STOP_BYTES = 1024
_U32 = struct.Struct("<I")
_U32x2 = struct.Struct("<II")


@dataclass(frozen=True, slots=True)
class Part:
    kind: PartKind
    data: bytes  # UTF-8 text, or a 32-byte digest

    @property
    def text(self) -> str:
        return self.data.decode("utf-8")


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    parts: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class Submission:
    messages: tuple[Message, ...]
    stop: tuple[str, ...] = field(default=())


def _validate_part(kind: int, data: bytes) -> Part:
    _check_enum(PartKind, kind, "part kind")
    pk = PartKind(kind)
    if pk is PartKind.TEXT:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("text part is not valid UTF-8") from None
    elif len(data) != DIGEST_SIZE:
        raise WireError(f"digest part must be exactly {DIGEST_SIZE} bytes, got {len(data)}")
    return Part(pk, data)


def encode_submission(sub: Submission) -> bytes:
    out = bytearray(_U32.pack(len(sub.messages)))
    for msg in sub.messages:
        out += _U32x2.pack(int(msg.role), len(msg.parts))
        for part in msg.parts:
            _validate_part(int(part.kind), part.data)
            out += _U32x2.pack(int(part.kind), len(part.data))
            out += part.data
    out += _U32.pack(len(sub.stop))
    for s in sub.stop:
        b = s.encode("utf-8")
        out += _U32.pack(len(b)) + b
    if len(out) > MAX_PAYLOAD:
        raise WireError(f"submission of {len(out)} bytes exceeds one packet", 413)
    return bytes(out)


class _Reader:
    """Bounds-checked reader over a payload: never reads past its end."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = bytes(data)
        self.pos = 0

    def u32(self) -> int:
        if self.pos + 4 > len(self.data):
            raise WireError("payload ends inside a 32-bit field")
        (v,) = _U32.unpack_from(self.data, self.pos)
        self.pos += 4
        return int(v)

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise WireError(f"count {n} overruns the payload")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def end(self) -> None:
        if self.pos != len(self.data):
            raise WireError(f"{len(self.data) - self.pos} trailing bytes after the payload")


def decode_submission(data: bytes | memoryview) -> Submission:
    r = _Reader(data)
    n_messages = r.u32()
    if n_messages == 0:
        raise WireError("a submission needs at least one message")
    if n_messages > MAX_MESSAGES:
        raise WireError(f"message count {n_messages} exceeds {MAX_MESSAGES}")
    messages = []
    for _ in range(n_messages):
        role = r.u32()
        _check_enum(Role, role, "message role")
        n_parts = r.u32()
        if n_parts > MAX_PARTS:
            raise WireError(f"part count {n_parts} exceeds {MAX_PARTS}")
        parts = []
        for _ in range(n_parts):
            kind = r.u32()
            size = r.u32()
            parts.append(_validate_part(kind, r.take(size)))
        messages.append(Message(Role(role), tuple(parts)))
    n_stop = r.u32()
    if n_stop > MAX_STOPS:
        raise WireError(f"stop count {n_stop} exceeds {MAX_STOPS}")
    stops = []
    for _ in range(n_stop):
        raw = r.take(r.u32())
        if not raw:
            raise WireError("empty stop string")
        if len(raw) > MAX_STOP_BYTES:
            raise WireError(f"stop string of {len(raw)} bytes exceeds {MAX_STOP_BYTES}")
        try:
            stops.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise WireError("stop string is not valid UTF-8") from None
    r.end()
    return Submission(tuple(messages), tuple(stops))


# --------------------------------------------------------------------------
# Information payload: 192-byte header, then model_count 40-byte rows, then a
# string area (aliases and digests) that rows point into by offset.
#
# Header:
#     0 u32 schema (1)          4 u32 abi (1)
#     8 u64 epoch              16 u32 model_count
#    20 u32 max_packet         24 u32 max_payload       28 u32 window_bytes
#    32 u32 context_tokens     36 u32 output_tokens     40 u32 active_requests
#    44 u32 slots              48 u64 media_bytes       56 u32 retention_seconds
#    60 u32 retention_requests 64 u32 mailboxes         68 u32 kv_cells
#    72 u64 started_unix_ns    80..155 reserved zero
#   156 u32 automatic-memory role bits (bit r = role r qualified)
#   160..191 reserved zero
# Model row (40 bytes):
#     0 u32 role               4 u32 input modality bits (1 text, 2 image, 4 audio)
#     8 u64 published_at (unix seconds)
#    16 u32 context_tokens    20 u32 alias offset   24 u32 alias length
#    28 u32 digest offset (32 bytes of SHA-256)     32 u64 reserved zero
# Offsets are relative to the start of the string area.
# --------------------------------------------------------------------------

INFO_HEADER = struct.Struct("<IIQIIIIIIIIQIIIIQ76sI32s")
INFO_ROW = struct.Struct("<IIQIIIIQ")
assert INFO_HEADER.size == 192 and INFO_ROW.size == 40

MOD_TEXT, MOD_IMAGE, MOD_AUDIO = 1, 2, 4
MODALITY_BITS = {"text": MOD_TEXT, "image": MOD_IMAGE, "audio": MOD_AUDIO}


def modality_names(mods: int) -> list[str]:
    """The names of the modality bits set in ``mods``, in bit order."""
    return [name for name, bit in MODALITY_BITS.items() if mods & bit]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    role: int
    alias: str
    sha256: bytes
    modalities: int
    published_at: int
    context_tokens: int
    automatic_memory: bool = False


@dataclass(frozen=True, slots=True)
class Info:
    epoch: int
    models: tuple[ModelInfo, ...]
    window_bytes: int
    context_tokens: int
    output_tokens: int
    active_requests: int
    slots: int
    media_bytes: int
    retention_seconds: int
    retention_requests: int
    mailboxes: int
    kv_cells: int
    started_unix_ns: int
    max_packet: int = MAX_PACKET
    max_payload: int = MAX_PAYLOAD


def encode_info(info: Info) -> bytes:
    strings = bytearray()
    rows = bytearray()
    am_bits = 0
    for m in info.models:
        if not 0 <= m.role < 32:
            raise WireError(f"model role {m.role} outside 0..31")
        if len(m.sha256) != DIGEST_SIZE:
            raise WireError("model digest must be 32 bytes")
        alias = m.alias.encode("utf-8")
        a_off = len(strings)
        strings += alias
        d_off = len(strings)
        strings += m.sha256
        rows += INFO_ROW.pack(m.role, m.modalities, m.published_at, m.context_tokens,
                              a_off, len(alias), d_off, 0)
        if m.automatic_memory:
            am_bits |= 1 << m.role
    head = INFO_HEADER.pack(1, 1, info.epoch, len(info.models), info.max_packet,
                            info.max_payload, info.window_bytes, info.context_tokens,
                            info.output_tokens, info.active_requests, info.slots,
                            info.media_bytes, info.retention_seconds,
                            info.retention_requests, info.mailboxes, info.kv_cells,
                            info.started_unix_ns, bytes(76), am_bits, bytes(32))
    return head + bytes(rows) + bytes(strings)


def decode_info(data: bytes | memoryview) -> Info:
    data = bytes(data)
    if len(data) < INFO_HEADER.size:
        raise WireError("information payload shorter than its 192-byte header")
    (schema, abi, epoch, count, max_packet, max_payload, window, ctx, out_tokens, active,
     slots, media, ret_s, ret_n, mailboxes, kv_cells, started, res1, am_bits,
     res2) = INFO_HEADER.unpack_from(data)
    if schema != 1 or abi != 1:
        raise WireError(f"unsupported information schema {schema}/{abi}")
    if any(res1) or any(res2):
        raise WireError("reserved information header bytes are not zero")
    rows_end = INFO_HEADER.size + count * INFO_ROW.size
    if rows_end > len(data):
        raise WireError(f"model count {count} overruns the payload")
    strings = data[rows_end:]
    models = []
    roles = set()
    for i in range(count):
        role, mods, pub, mctx, a_off, a_len, d_off, res = INFO_ROW.unpack_from(
            data, INFO_HEADER.size + i * INFO_ROW.size)
        if res:
            raise WireError("reserved model row bytes are not zero")
        if role >= 32 or role in roles:
            raise WireError(f"bad or repeated model role {role}")
        roles.add(role)
        if a_off + a_len > len(strings) or d_off + DIGEST_SIZE > len(strings):
            raise WireError("model row string offsets overrun the payload")
        try:
            alias = strings[a_off:a_off + a_len].decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("model alias is not valid UTF-8") from None
        models.append(ModelInfo(role, alias, strings[d_off:d_off + DIGEST_SIZE], mods, pub,
                                mctx, bool(am_bits >> role & 1)))
    visible = 0
    for r in roles:
        visible |= 1 << r
    if am_bits & ~visible:
        raise WireError("automatic-memory bits set for roles that are not visible")
    return Info(epoch, tuple(models), window, ctx, out_tokens, active, slots, media, ret_s,
                ret_n, mailboxes, kv_cells, started, max_packet, max_payload)


# --------------------------------------------------------------------------
# Grant rows (64 bytes each; the header's offset 76 holds the row count)
#
#     0 u32 principal          4 u32 flags (bit 0: automatic memory enabled)
#     8 u64 revision (assigned by the device on install; 0 in install requests)
#    16 u32 action mask       20 u32 reserved zero
#    24 u64 model mask (bit r = model role r)
#    32 u32 max active requests (0 = device default)
#    36 u32 max output tokens per request (0 = device default)
#    40 u32 max input bytes per request (0 = device default)
#    44 u32 max media sources (0 = device default)
#    48 u64 max media bytes (0 = device default)
#    56 u32 admissions per minute (0 = unlimited)
#    60 u32 reserved zero
# --------------------------------------------------------------------------

GRANT_ROW = struct.Struct("<IIQIIQIIIIQII")
assert GRANT_ROW.size == 64
GRANT_FLAG_MEMORY = 1


@dataclass(frozen=True, slots=True)
class Grant:
    principal: int
    actions: int
    model_mask: int
    revision: int = 0
    flags: int = 0
    max_active: int = 0
    max_output_tokens: int = 0
    max_input_bytes: int = 0
    max_media_sources: int = 0
    max_media_bytes: int = 0
    rate_per_minute: int = 0


#: Grant rows in one packet: one GRANT_INSTALL, or one GRANT_READ reply (a full page
#: means "ask again from the next principal").
GRANT_PAGE = 1000


def encode_grants(grants: list[Grant] | tuple[Grant, ...]) -> bytes:
    if len(grants) * GRANT_ROW.size > MAX_PAYLOAD:
        raise WireError("too many grant rows for one packet", 413)
    try:
        return b"".join(
            GRANT_ROW.pack(g.principal, g.flags, g.revision, g.actions, 0, g.model_mask,
                           g.max_active, g.max_output_tokens, g.max_input_bytes,
                           g.max_media_sources, g.max_media_bytes, g.rate_per_minute, 0)
            for g in grants)
    except struct.error as exc:
        raise WireError(f"grant field out of range: {exc}") from None


def decode_grants(data: bytes | memoryview, count: int) -> list[Grant]:
    if len(data) != count * GRANT_ROW.size:
        raise WireError(f"{count} grant rows need {count * GRANT_ROW.size} bytes, got {len(data)}")
    out = []
    for i in range(count):
        (principal, flags, revision, actions, res1, models, active, out_tokens, in_bytes,
         media_n, media_b, rate, res2) = GRANT_ROW.unpack_from(data, i * GRANT_ROW.size)
        if res1 or res2:
            raise WireError("reserved grant row bytes are not zero")
        if actions & ~0xFF:
            raise WireError(f"unknown action bits {actions & ~0xFF:#x}")
        if flags & ~GRANT_FLAG_MEMORY:
            raise WireError("unknown grant flags")
        if principal == 0:
            raise WireError("principal 0 is reserved")
        out.append(Grant(principal, actions, models, revision, flags, active, out_tokens,
                         in_bytes, media_n, media_b, rate))
    return out


# --------------------------------------------------------------------------
# Media list rows: 80 bytes = 16-byte source id + 64-byte media-read metadata.
#
# Media-read metadata (64 bytes):
#     0 32s sha256 digest      32 u64 byte count
#    40 u32 kind (PartKind: 1 image, 2 audio)
#    44 u32 state (1 receiving, 2 ready, 3 refused)
#    48 u32 leases            52 u32 content type code (see MEDIA_TYPES)
#    56 u64 created (unix milliseconds)
# --------------------------------------------------------------------------

MEDIA_META = struct.Struct("<32sQIIIIQ")
MEDIA_ROW_SIZE = 80
assert MEDIA_META.size == 64


class MediaState(enum.IntEnum):
    RECEIVING = 1
    READY = 2
    REFUSED = 3


#: Content type codes carried in media metadata.
MEDIA_TYPES: dict[int, str] = {
    1: "image/png", 2: "image/jpeg", 3: "image/webp", 4: "image/gif",
    16: "audio/wav", 17: "audio/mpeg", 18: "audio/flac", 19: "audio/ogg",
}


#: content type -> (code in media metadata, kind)
CONTENT_TYPES: dict[str, tuple[int, PartKind]] = {
    ct: (code, PartKind.IMAGE_DIGEST if ct.startswith("image/") else PartKind.AUDIO_DIGEST)
    for code, ct in MEDIA_TYPES.items()
}
#: aliases some clients send
CONTENT_TYPES["audio/x-wav"] = CONTENT_TYPES["audio/wav"]
CONTENT_TYPES["audio/wave"] = CONTENT_TYPES["audio/wav"]
CONTENT_TYPES["audio/mp3"] = CONTENT_TYPES["audio/mpeg"]
CONTENT_TYPES["audio/x-flac"] = CONTENT_TYPES["audio/flac"]


@dataclass(frozen=True, slots=True)
class MediaMeta:
    digest: bytes
    size: int
    kind: PartKind
    state: MediaState
    leases: int
    content_type: int
    created_ms: int


def encode_media_meta(m: MediaMeta) -> bytes:
    return MEDIA_META.pack(m.digest, m.size, int(m.kind), int(m.state), m.leases,
                           m.content_type, m.created_ms)


def decode_media_meta(data: bytes | memoryview) -> MediaMeta:
    if len(data) != MEDIA_META.size:
        raise WireError("media metadata must be 64 bytes")
    digest, size, kind, state, leases, ctype, created = MEDIA_META.unpack_from(data)
    _check_enum(PartKind, kind, "media kind")
    if kind == PartKind.TEXT:
        raise WireError("media kind cannot be text")
    _check_enum(MediaState, state, "media state")
    if ctype not in MEDIA_TYPES:
        raise WireError(f"unknown content type code {ctype}")
    return MediaMeta(bytes(digest), size, PartKind(kind), MediaState(state), leases, ctype,
                     created)


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


# --------------------------------------------------------------------------
# Policy (operation 12)
#
# Control payload (16 bytes): u32 schema (1), u32 action, u64 expected revision.
# Status (160 bytes): eight u32 words (schema, abi, mode, state, review_enabled,
# pending, active_rows, result_status), eleven u64 from byte 32 (control_revision,
# source_frontier, completed, interrupted, refused, decision, saved_generation,
# max_ns, last_ns, written_bytes, result_bytes), u32 reason at 120, zero to 159.
# --------------------------------------------------------------------------

POLICY_CONTROL = struct.Struct("<IIQ")
POLICY_STATUS = struct.Struct("<8I11QI36s")
assert POLICY_CONTROL.size == 16 and POLICY_STATUS.size == 160


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


@dataclass(frozen=True, slots=True)
class PolicyControl:
    action: PolicyAction
    expected_revision: int


def encode_policy_control(c: PolicyControl) -> bytes:
    return POLICY_CONTROL.pack(1, int(c.action), c.expected_revision)


def decode_policy_control(data: bytes | memoryview) -> PolicyControl:
    if len(data) != POLICY_CONTROL.size:
        raise WireError("policy control payload must be 16 bytes")
    schema, action, rev = POLICY_CONTROL.unpack_from(data)
    if schema != 1:
        raise WireError(f"unsupported policy control schema {schema}")
    _check_enum(PolicyAction, action, "policy action")
    return PolicyControl(PolicyAction(action), rev)


@dataclass(frozen=True, slots=True)
class PolicyStatus:
    mode: int = 0
    state: PolicyState = PolicyState.OFF
    review_enabled: int = 0
    pending: int = 0
    active_rows: int = 0
    result_status: int = 0
    control_revision: int = 0
    source_frontier: int = 0
    completed: int = 0
    interrupted: int = 0
    refused: int = 0
    decision: int = 0
    saved_generation: int = 0
    max_ns: int = 0
    last_ns: int = 0
    written_bytes: int = 0
    result_bytes: int = 0
    reason: PolicyReason = PolicyReason.QUIET
    schema: int = 1
    abi: int = 1


def encode_policy_status(s: PolicyStatus) -> bytes:
    return POLICY_STATUS.pack(
        s.schema, s.abi, s.mode, int(s.state), s.review_enabled, s.pending, s.active_rows,
        s.result_status, s.control_revision, s.source_frontier, s.completed, s.interrupted,
        s.refused, s.decision, s.saved_generation, s.max_ns, s.last_ns, s.written_bytes,
        s.result_bytes, int(s.reason), bytes(36))


def decode_policy_status(data: bytes | memoryview) -> PolicyStatus:
    if len(data) != POLICY_STATUS.size:
        raise WireError("policy status must be 160 bytes")
    v = POLICY_STATUS.unpack_from(data)
    if any(v[20]):
        raise WireError("policy status bytes 124..159 are not zero")
    _check_enum(PolicyState, v[3], "policy state")
    _check_enum(PolicyReason, v[19], "policy reason")
    return PolicyStatus(
        schema=v[0], abi=v[1], mode=v[2], state=PolicyState(v[3]), review_enabled=v[4],
        pending=v[5], active_rows=v[6], result_status=v[7], control_revision=v[8],
        source_frontier=v[9], completed=v[10], interrupted=v[11], refused=v[12], decision=v[13],
        saved_generation=v[14], max_ns=v[15], last_ns=v[16], written_bytes=v[17],
        result_bytes=v[18], reason=PolicyReason(v[19]))


# --------------------------------------------------------------------------
# Telemetry payload (operation 13): four u64
#   0 service allocation bytes   8 device tick   16 device clock ns   24 reserved zero
# --------------------------------------------------------------------------

TELEMETRY = struct.Struct("<QQQQ")


@dataclass(frozen=True, slots=True)
class Telemetry:
    allocation_bytes: int
    tick: int
    clock_ns: int


def encode_telemetry(t: Telemetry) -> bytes:
    return TELEMETRY.pack(t.allocation_bytes, t.tick, t.clock_ns, 0)


def decode_telemetry(data: bytes | memoryview) -> Telemetry:
    if len(data) != TELEMETRY.size:
        raise WireError("telemetry payload must be 32 bytes")
    a, t, c, res = TELEMETRY.unpack_from(data)
    if res:
        raise WireError("reserved telemetry bytes are not zero")
    return Telemetry(a, t, c)


# --------------------------------------------------------------------------
# Request ids: req-<16 hex epoch>-<32 hex identity>
# --------------------------------------------------------------------------

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
