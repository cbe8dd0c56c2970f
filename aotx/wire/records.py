"""The fixed records: grant rows, media metadata and list rows, the policy's control and
status, telemetry."""

from __future__ import annotations

import enum
import struct
from typing import Annotated, NamedTuple

from .enums import IDENTITY_SIZE, MAX_PAYLOAD, PartKind, Reason, WireError, _check_enum
from .info import PART_MODALITY
from .table import F, layout

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


# -- A dry run's pieces (SUBMIT_DRY_PIECES): each token as its id (i32), the length of
# its bytes (u16) and those bytes, as many whole records as one reply holds.

_PIECE = struct.Struct("<iH")


def encode_pieces(pieces: list[tuple[int, bytes]], room: int = MAX_PAYLOAD) -> tuple[bytes, int]:
    """The records of the first pieces that fit ``room`` bytes, and how many those are."""
    out = bytearray()
    for n, (token, data) in enumerate(pieces):
        if len(out) + _PIECE.size + len(data) > room:
            return bytes(out), n
        out += _PIECE.pack(token, len(data)) + data
    return bytes(out), len(pieces)


def decode_pieces(data: bytes | memoryview) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        if pos + _PIECE.size > len(data):
            raise WireError("a piece record is cut short")
        token, size = _PIECE.unpack_from(data, pos)
        pos += _PIECE.size
        if pos + size > len(data):
            raise WireError("a piece's bytes are cut short")
        out.append((token, bytes(data[pos:pos + size])))
        pos += size
    return out
