"""Media sources on the device: content types, magic checks, the source table.

A source is uploaded in one or more MEDIA_PUT packets, assembled on the
device, hashed (SHA-256) and checked against the magic bytes of its declared
content type.  It is then ``ready`` (usable by digest in submissions of its
owner) or ``refused`` (kept as a row with a reason, without its bytes, and
excluded from lists).  Requests lease the sources they name from admission to
their terminal state; a leased source cannot be removed (409).

An *ephemeral* source (MEDIA_FLAG_EPHEMERAL: media sent inline in a chat
request rather than uploaded) is the same, except that it is removed when its
last lease ends, or after ``EPHEMERAL_SECONDS`` if no request ever leases it,
and it is not listed.  Uploading the same bytes as a named source makes it an
ordinary one.
"""

from __future__ import annotations

import ctypes
import hashlib
import secrets
import time
from dataclasses import dataclass, field

from .. import wire
from ..wire import Reason
from .errors import DeviceError

UPLOAD_IDLE_SECONDS = 60.0
EPHEMERAL_SECONDS = 60.0  # an ephemeral source no request leased is removed after this
#: Refused sources kept (for their reason) per principal; older ones are dropped.
MAX_REFUSED = 64
#: Removing a source at least this large hands freed heap memory back to the system.
TRIM_BYTES = 1 << 20

_libc = ctypes.CDLL(None)


def give_back_memory() -> None:
    """Return the allocator's free memory to the system: glibc serves allocations below its
    mmap threshold (raised up to 32 MiB by earlier large frees) from the heap, and a freed
    source there would stay in the device's RSS (glibc's ``malloc_trim``)."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def magic_matches(code: int, data: bytes) -> bool:
    """Do the first bytes of ``data`` look like content type ``code``?"""
    ct = wire.MEDIA_TYPES.get(code, "")
    if ct == "image/png":
        return data.startswith(b"\x89PNG\r\n\x1a\n")
    if ct == "image/jpeg":
        return data.startswith(b"\xff\xd8\xff")
    if ct == "image/webp":
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    if ct == "image/gif":
        return data[:6] in (b"GIF87a", b"GIF89a")
    if ct == "audio/wav":
        return data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    if ct == "audio/mpeg":
        return data.startswith(b"ID3") or (len(data) > 1 and data[0] == 0xFF
                                           and data[1] & 0xE0 == 0xE0)
    if ct == "audio/flac":
        return data.startswith(b"fLaC")
    if ct == "audio/ogg":
        return data.startswith(b"OggS")
    return False


@dataclass(eq=False)
class Source:
    id: bytes
    principal: int
    digest: bytes
    content_type: int
    size: int
    state: wire.MediaState
    position: int  # source-table position (for pagination), increasing
    created_ms: int
    reason: Reason = Reason.NONE  # why a refused source was refused
    leases: int = 0
    data: bytes = b""
    ephemeral: bool = False
    touched: float = field(default_factory=time.monotonic)  # last upload or lease change
    claims: int = 0  # inline uploads of these bytes whose request has not leased them yet

    @property
    def kind(self) -> wire.PartKind:
        return wire.media_kind(self.content_type)

    def meta(self) -> wire.MediaMeta:
        return wire.MediaMeta(self.digest, self.size, self.kind, self.state, self.leases,
                              self.content_type, self.created_ms)


@dataclass(eq=False)
class Upload:
    principal: int
    content_type: int
    buf: bytearray = field(default_factory=bytearray)
    touched: float = field(default_factory=time.monotonic)


class MediaTable:
    """All sources of this device activation.  Guarded by the device lock."""

    def __init__(self, max_source_bytes: int, max_total_bytes: int, share_bytes: int) -> None:
        self.max_source_bytes = max_source_bytes
        self.max_total_bytes = max_total_bytes
        self.share_bytes = share_bytes  # what one principal may hold unless its grant says
        self.sources: dict[bytes, Source] = {}
        self.by_digest: dict[tuple[int, bytes], bytes] = {}  # (principal, digest) -> ready id
        self.uploads: dict[tuple[int, bytes], Upload] = {}
        self.position = 0
        self.total_bytes = 0  # bytes of ready sources and uploads in progress

    def _usage(self, principal: int, but: tuple[int, bytes] | None = None) -> tuple[int, int]:
        """(sources, bytes) the principal holds: ready sources and uploads in progress
        (other than ``but``), so that parallel uploads cannot each use the whole grant."""
        mine = [s for s in self.sources.values()
                if s.principal == principal and s.state is wire.MediaState.READY]
        ups = [u for k, u in self.uploads.items() if k[0] == principal and k != but]
        return len(mine) + len(ups), sum(s.size for s in mine) + sum(len(u.buf) for u in ups)

    def put(self, principal: int, upload_id: bytes, offset: int, content_type: int,
            chunk: bytes, final: bool, abort: bool, grant: wire.Grant,
            ephemeral: bool = False) -> tuple[int, Source | None]:
        """Take one chunk.  Returns (status, source): 202 while receiving, 201 new, 200 existing."""
        key = (principal, upload_id)
        if abort:
            up = self.uploads.pop(key, None)
            if up is not None:
                self.total_bytes -= len(up.buf)
            return 200, None
        up = self.uploads.get(key)
        if up is None:
            if offset != 0:
                raise DeviceError(409, Reason.UPLOAD_OFFSET)
            if content_type not in wire.MEDIA_TYPES:
                raise DeviceError(415, Reason.CONTENT_TYPE)
            count, _ = self._usage(principal, but=key)
            if grant.max_media_sources and count >= grant.max_media_sources:
                raise DeviceError(413, Reason.SOURCE_COUNT, grant.max_media_sources)
            up = Upload(principal, content_type)
            self.uploads[key] = up
        elif offset != len(up.buf) or content_type != up.content_type:
            raise DeviceError(409, Reason.UPLOAD_OFFSET)
        self._check_room(key, len(up.buf) + len(chunk), len(chunk), grant)
        up.buf += chunk
        up.touched = time.monotonic()
        self.total_bytes += len(chunk)
        if not final:
            return 202, None
        del self.uploads[key]
        data = bytes(up.buf)
        self.total_bytes -= len(data)
        digest = hashlib.sha256(data).digest()
        existing = self.by_digest.get((principal, digest))
        if existing is not None and not magic_matches(up.content_type, data):
            existing = None  # the same bytes under a type they are not: refused, as new ones
        if existing is not None:
            src = self.sources[existing]
            if not ephemeral:
                src.ephemeral = False  # uploaded by name: an ordinary source from now on
            src.touched = time.monotonic()
            src.claims += ephemeral
            return 200, src
        self.position += 1
        src = Source(secrets.token_bytes(16), principal, digest, up.content_type, len(data),
                     wire.MediaState.READY, self.position, int(time.time() * 1000),
                     ephemeral=ephemeral, claims=int(ephemeral))
        if not data:
            src.state, src.reason = wire.MediaState.REFUSED, Reason.EMPTY
        elif not magic_matches(up.content_type, data):
            src.state, src.reason = wire.MediaState.REFUSED, Reason.MAGIC
        if src.state is wire.MediaState.READY:
            src.data = data
            self.total_bytes += len(data)
            self.by_digest[(principal, digest)] = src.id
        else:
            refused = [x for x in self.sources.values()
                       if x.principal == principal and x.state is wire.MediaState.REFUSED]
            for old in refused[:max(0, len(refused) - MAX_REFUSED + 1)]:
                del self.sources[old.id]  # oldest first: a refused row holds no bytes
        self.sources[src.id] = src
        return 201, src

    def _check_room(self, key: tuple[int, bytes], size: int, adding: int,
                    grant: wire.Grant) -> None:
        """Refuse (and drop the upload) a chunk that would make the source larger than a
        source may be, the principal's sources larger than its share of the pool (the
        grant's media bytes, else ``share_bytes``), or the pool larger than it is: three
        different answers, each naming its own limit."""
        refusal: tuple[int, Reason, int] | None = None
        share = grant.max_media_bytes or self.share_bytes
        if size > self.max_source_bytes:
            refusal = (413, Reason.SOURCE_BYTES, self.max_source_bytes)
        elif self._usage(key[0], but=key)[1] + size > share:
            refusal = (413, Reason.MEDIA_SHARE, share)
        elif self.total_bytes + adding > self.max_total_bytes:
            refusal = (507, Reason.MEDIA_POOL, 0)
        if refusal is not None:
            self.total_bytes -= len(self.uploads.pop(key).buf)
            raise DeviceError(*refusal)

    def get(self, principal: int, source_id: bytes) -> Source:
        src = self.sources.get(source_id)
        if src is None or src.principal != principal:
            raise DeviceError(404, Reason.NO_SOURCE_ID)
        return src

    def remove(self, principal: int, source_id: bytes) -> None:
        src = self.get(principal, source_id)
        if src.leases:
            raise DeviceError(409, Reason.LEASED, src.leases)
        del self.sources[source_id]
        if src.state is wire.MediaState.READY:
            self.total_bytes -= src.size
            self.by_digest.pop((principal, src.digest), None)
            if src.size >= TRIM_BYTES:
                src.data = b""
                give_back_memory()

    def page(self, principal: int, cursor: int, limit: int) -> tuple[list[Source], int]:
        """The caller's non-refused sources from table position ``cursor``; next cursor or 0."""
        mine = sorted((s for s in self.sources.values()
                       if s.principal == principal and s.state is not wire.MediaState.REFUSED
                       and not s.ephemeral and s.position >= cursor), key=lambda s: s.position)
        page = mine[:limit]
        nxt = mine[limit].position if len(mine) > limit else 0
        return page, nxt

    def ready_by_digest(self, principal: int, digest: bytes) -> Source | None:
        sid = self.by_digest.get((principal, digest))
        return self.sources.get(sid) if sid is not None else None

    def unlease(self, source_id: bytes) -> None:
        """A request holding ``source_id`` ended; an ephemeral source goes with its last lease."""
        src = self.sources.get(source_id)
        if src is None:
            return
        src.leases -= 1
        src.touched = time.monotonic()
        # claims: the same bytes were just sent inline again, for a request that has
        # not leased them yet; that request's lease (or the sweep) removes the source.
        if src.ephemeral and src.leases == 0 and src.claims == 0:
            self.remove(src.principal, src.id)

    def lease(self, src: Source) -> None:
        src.leases += 1
        src.claims = max(0, src.claims - 1)
        src.touched = time.monotonic()

    def sweep(self, now: float) -> None:
        for key, up in list(self.uploads.items()):
            if now - up.touched > UPLOAD_IDLE_SECONDS:
                self.total_bytes -= len(up.buf)
                del self.uploads[key]
        for src in [s for s in self.sources.values() if s.ephemeral and not s.leases
                    and now - s.touched > EPHEMERAL_SECONDS]:
            self.remove(src.principal, src.id)
