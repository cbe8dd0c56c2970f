"""The INFO payload: the device's head, a row per model, and their strings."""

from __future__ import annotations

from typing import Annotated, NamedTuple

from .enums import (
    DIGEST_SIZE,
    MAX_PACKET,
    MAX_PAYLOAD,
    SUBMIT_TOOL_FORMAT,
    SUBMIT_TOOL_FORMAT_SHIFT,
    PartKind,
    ToolFormat,
    WireError,
    _check_enum,
)
from .table import F, layout

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
    rerank: bool = False  # a reranker: its EMBED scores documents against a query


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
    rerank_roles: Annotated[int, F("I", 80, False, "bit r: role r is a reranker")] = 0
    reserved_84: Annotated[bytes, F("72s", 84, True, "zero")] = bytes(72)
    memory_roles: Annotated[int, F("I", 156, True, "bit r: role r qualified")] = 0
    reserved_160: Annotated[bytes, F("32s", 160, True, "zero")] = bytes(32)
    models: tuple[ModelInfo, ...] = ()


INFO_HEADER, INFO_ROW = layout(Info, 192), layout(ModelRow, 40)


def encode_info(info: Info) -> bytes:
    strings, table, roles, rerank = bytearray(), bytearray(), 0, 0
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
        rerank |= int(m.rerank) << m.role
    head = info._replace(model_count=len(info.models), memory_roles=roles, rerank_roles=rerank)
    return INFO_HEADER.pack(*head[:-1]) + bytes(table) + bytes(strings)  # all but models


def decode_info(data: bytes | memoryview) -> Info:
    data = bytes(data)
    if len(data) < INFO_HEADER.size:
        raise WireError("information payload shorter than its 192-byte header")
    info = Info._make((*INFO_HEADER.unpack_from(data), ()))
    if info.schema != 1 or info.abi != 1:
        raise WireError(f"unsupported information schema {info.schema}/{info.abi}")
    if any(info.reserved_84) or any(info.reserved_160):
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
                                r.embedding_dims, r.embedding_tokens, _tool_format(r.tool_format),
                                bool(info.rerank_roles >> r.role & 1)))
    if (info.memory_roles | info.rerank_roles) & ~visible:
        raise WireError("automatic-memory or reranker bits set for roles that are not visible")
    return info._replace(models=tuple(models))
