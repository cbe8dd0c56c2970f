"""The HTTP gateway: authentication, JSON/SSE, UTF-8 decoding; no request state.

Everything a client can read lives on the device; the gateway translates HTTP
into broker packets and back.  It keeps only transport conveniences: the model
list learned from the device's information payload, the grants it installs,
and the current runtime epoch (when a reply shows a new epoch, the device has
restarted: the gateway re-reads the information payload and reinstalls grants).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import codecs
import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import wire
from ..cpuslice import request_short_slice
from ..paths import RuntimePaths
from . import schemas as S
from .broker_client import BrokerClient, BrokerUnavailable
from .credentials import CredentialStore, PrincipalGrant, ensure_admin_token, token_hash
from .errors import ApiError, error_body
from .guard import BODY_IDLE_TIMEOUT, GuardedHttpToolsProtocol
from .requests import (
    ChatRequest,
    ImageUrlPart,
    InputAudioPart,
    MediaPart,
    PolicyControlBody,
    b64,
)

log = logging.getLogger("aotx.gateway")

MAX_BODY = 1 << 20  # bytes of JSON accepted on any route
WAIT_MS = 10_000  # a parked WAIT answers at least this often (keep-alive cadence)
#: A principal's streams park at most this share of the mailboxes in WAITs; its
#: streams beyond that poll (READ every WAIT_POLL_S) so that one principal's many open
#: streams cannot leave every mailbox taken and the others' calls answered 503.
WAIT_SHARE = 0.5
WAIT_POLL_S = 0.05
ADMIN_PRINCIPAL = 1
_CURSOR_RE = re.compile(r"[0-9]{1,20}")  # ASCII digits only (str.isdigit takes "²")
_PHASE_NAMES = {p: p.name.lower() for p in wire.Phase}
_FINISH_NAMES = {wire.Finish.NONE: None, wire.Finish.STOP: "stop", wire.Finish.LENGTH: "length"}
_ROLES = {"system": wire.Role.SYSTEM, "developer": wire.Role.SYSTEM, "user": wire.Role.USER,
          "assistant": wire.Role.ASSISTANT}
_FAILURES = {500: "the engine failed while decoding this request",
             503: "the engine ran out of KV cache for this request"}


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


@dataclass(frozen=True)
class Principal:
    id: int
    name: str
    grant: PrincipalGrant


def parse_cursor(value: str | None, param: str = "cursor") -> int:
    if value is None:
        return 0
    if not _CURSOR_RE.fullmatch(value) or int(value) >= 1 << 64:
        raise ApiError(400, f"{param} must be a decimal byte offset below 2^64", param=param)
    return int(value)


class Gateway:
    def __init__(self, paths: RuntimePaths) -> None:
        self.paths = paths
        self.broker = BrokerClient(paths.socket)
        self.info: wire.Info | None = None
        self.epoch = 0
        self.models: dict[str, wire.ModelInfo] = {}
        self.by_role: dict[int, wire.ModelInfo] = {}
        self._refresh_lock = asyncio.Lock()
        self.store = CredentialStore(paths.state_dir)
        self.store.ensure_token("admin", ensure_admin_token(paths.admin_token),
                                int(wire.Action.all()))
        self.generation = -1
        self.tokens: dict[bytes, int] = {}
        self.principals: dict[int, PrincipalGrant] = {}
        self.installed: dict[int, wire.Grant] = {}  # what the device holds, less revisions
        self._sync_lock = asyncio.Lock()
        # True from a credential change until its rows are on the device: a failed
        # install (broker busy or restarting) is tried again, by the next request or
        # the poll loop, and requests wait for it rather than run under old grants.
        self.grants_dirty = False
        self.parked: dict[int, int] = {}  # principal id -> WAITs it has in flight
        self._load_credentials()

    # -- authentication --------------------------------------------------------
    def _load_credentials(self) -> bool:
        gen = self.store.generation()
        if gen == self.generation:
            return False
        self.tokens, self.principals = self.store.snapshot()
        self.generation = gen
        self.grants_dirty = True
        return True

    async def authenticate(self, request: Request) -> Principal:
        """Map the bearer token to a principal, with the credential store's latest state.

        The store's generation is checked on every call (one indexed SQLite
        read), so a revoked token is refused at once and a changed grant is
        installed on the device before this request goes on.
        """
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        self._load_credentials()
        if self.grants_dirty and self.info is not None:
            try:
                await self.sync_grants()
            except BrokerUnavailable as exc:
                raise ApiError(503, f"the device is not reachable: {exc}") from None
        # The lookup is keyed by SHA-256 of the presented token, never by the token:
        # timing can at most reveal something about a hash, which does not help
        # anyone forge a 256-bit token (the timing-safe design of hashed lookup).
        pid = self.tokens.get(token_hash(token.strip()))
        if pid is None:
            raise ApiError(401, "invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
        grant = self.principals[pid]
        return Principal(pid, grant.name, grant)

    def grants(self) -> list[wire.Grant]:
        """Rows for every principal: those without a live token get no actions at all."""
        roles = {m.alias: m.role for m in self.models.values()}
        rows = []
        for p in self.store.principals():
            row = p.row(roles)
            if p.id not in self.principals:
                row = wire.Grant(principal=p.id, actions=0, model_mask=0)
            rows.append(row)
        return rows

    async def sync_grants(self) -> None:
        """Install the grant rows that differ from what the device holds."""
        async with self._sync_lock:
            generation = self.generation
            rows = [g for g in self.grants() if self.installed.get(g.principal) != g]
            for i in range(0, len(rows), wire.GRANT_PAGE):
                chunk = rows[i:i + wire.GRANT_PAGE]
                gh, body = await self.broker.call(
                    wire.Header(op=wire.Op.GRANT_INSTALL, total=len(chunk)),
                    wire.encode_grants(chunk))
                if gh.status != 200:
                    raise BrokerUnavailable(f"grant installation refused: {gh.status}")
                for g in chunk:
                    self.installed[g.principal] = g
            # Clean unless the credentials changed again while these were installed.
            self.grants_dirty = self.generation != generation
            if rows:
                log.info("event=gateway.grants_installed rows=%d generation=%d", len(rows),
                         generation)

    # -- device calls ------------------------------------------------------------
    async def refresh(self) -> None:
        """Learn the device's models and epoch; install grants when the epoch is new.

        Grants are installed once per epoch only: installing bumps revisions,
        and a bumped revision hides results admitted under the previous one.
        """
        async with self._refresh_lock:
            h, body = await self.broker.call(wire.Header(op=wire.Op.INFO))
            if h.status != 200:
                raise BrokerUnavailable(f"device information refused: {h.status}")
            info = wire.decode_info(body)
            new_epoch = self.info is None or info.epoch != self.epoch
            self.models = {m.alias: m for m in info.models}
            self.by_role = {m.role: m for m in info.models}
            if new_epoch:
                # Start from what the device already holds (a gateway restart must not
                # bump revisions: that would hide every result admitted before it).  A
                # refused read is not "nothing held": fail, and try the epoch again.
                held = await self.read_grants()
                self.installed = {g.principal: dataclasses.replace(g, revision=0) for g in held}
                self.grants_dirty = True
                await self.sync_grants()
            # The epoch counts as known only once its grants are installed: a failure
            # above leaves it new, so the next call or poll installs them again.
            self.info = info
            self.epoch = info.epoch
            if new_epoch:
                log.info("event=gateway.device_epoch epoch=%d models=%s", info.epoch,
                         ",".join(m.alias for m in info.models))

    async def read_grants(self) -> list[wire.Grant]:
        """Every row the device holds, a page (``GRANT_PAGE`` rows) at a time."""
        held: list[wire.Grant] = []
        while True:
            start = held[-1].principal + 1 if held else 0
            rh, rows = await self.broker.call(wire.Header(op=wire.Op.GRANT_READ, cursor=start))
            if rh.status != 200:
                raise BrokerUnavailable(f"grant read refused: {rh.status}")
            page = wire.decode_grants(rows, rh.total)
            held += page
            if len(page) < wire.GRANT_PAGE:
                return held

    async def ensure_ready(self) -> None:
        if self.info is None:
            try:
                await self.refresh()
            except BrokerUnavailable as exc:
                raise ApiError(503, f"the device is not reachable: {exc}") from None

    async def call(self, h: wire.Header, payload: bytes = b"",
                   timeout: float = 120.0) -> tuple[wire.Header, bytes]:
        await self.ensure_ready()
        try:
            rh, body = await self.broker.call(h, payload, timeout)
            if rh.epoch and rh.epoch != self.epoch:
                # The device restarted: reinstall grants, then retry a refusal once.
                await self.refresh()
                if rh.status == 403:
                    rh, body = await self.broker.call(h, payload, timeout)
        except BrokerUnavailable as exc:
            raise ApiError(503, f"the device is not reachable: {exc}") from None
        return rh, body

    async def ask(self, principal: Principal, op: wire.Op, payload: bytes = b"",
                  **fields: Any) -> tuple[wire.Header, bytes]:
        """One operation on behalf of ``principal``; a refusal becomes an ApiError."""
        rh, body = await self.call(wire.Header(op=op, principal=principal.id, **fields), payload)
        self.raise_for(rh, body)
        return rh, body

    async def poll_loop(self) -> None:
        """Notice device restarts while idle, so grants are back before the next call."""
        while True:
            try:
                if self.info is None:
                    await self.refresh()
                else:
                    h, _ = await self.broker.call(wire.Header(op=wire.Op.INFO), timeout=5)
                    if h.epoch != self.epoch:
                        await self.refresh()
                    elif self._load_credentials() or self.grants_dirty:
                        await self.sync_grants()
            except (BrokerUnavailable, wire.WireError) as exc:
                log.debug("event=gateway.device_unreachable error=%s", exc)
            await asyncio.sleep(0.5 if self.info is not None else 0.2)

    # -- helpers --------------------------------------------------------------------
    def visible_models(self, principal: Principal) -> list[wire.ModelInfo]:
        return [m for m in self.models.values() if principal.grant.allows_model(m.alias)]

    def model_for(self, alias: str, principal: Principal) -> wire.ModelInfo:
        m = self.models.get(alias)
        if m is None or not principal.grant.allows_model(alias):
            raise ApiError(404, f"the model {alias!r} does not exist", param="model",
                           code="model_not_found")
        return m

    def request_id(self, h: wire.Header) -> str:
        return wire.format_request_id(h.epoch, h.identity)

    def parse_id(self, rid: str) -> tuple[int, bytes]:
        parsed = wire.parse_request_id(rid)
        if parsed is None:
            raise ApiError(404, "no such request")
        return parsed

    def raise_for(self, h: wire.Header, body: bytes, ok: tuple[int, ...] = (200,)) -> None:
        if h.status in ok:
            return
        message = body.decode("utf-8", errors="replace") or f"device status {h.status}"
        headers = {"Retry-After": str(max(1, h.max_tokens))} if h.status == 429 else None
        raise ApiError(h.status if 400 <= h.status < 600 else 500, message, headers=headers)

    def state_fields(self, h: wire.Header) -> dict[str, Any]:
        m = self.by_role.get(h.role)
        failure = None
        if h.phase == wire.Phase.FAILED:
            failure = error_body(h.failure or 500, _FAILURES.get(h.failure, "the request failed"))["error"]
        return {
            "id": self.request_id(h),
            "runtime_epoch": str(h.epoch),
            "model": m.alias if m else None,
            "model_role": h.role,
            "state": _PHASE_NAMES[wire.Phase(h.phase)],
            "cancel_requested": bool(h.cancel_requested),
            "finish_reason": _FINISH_NAMES[wire.Finish(h.finish)],
            "failure": failure,
            "usage": {"prompt_tokens": h.prompt_tokens, "completion_tokens": h.sampled_tokens,
                      "total_tokens": h.prompt_tokens + h.sampled_tokens},
        }

    def submission(self, body: ChatRequest, principal: Principal, allow_media: bool,
                   inline: dict[int, wire.Part] | None = None,
                   ) -> tuple[wire.Header, bytes, wire.ModelInfo, list[str]]:
        m = self.model_for(body.model, principal)
        messages = []
        media: list[str] = []
        for msg in body.messages:
            parts = []
            for part in msg.parts():
                if isinstance(part, ImageUrlPart | InputAudioPart):
                    if inline is None or id(part) not in inline:
                        raise ApiError(400, "inline media was not uploaded", param="messages")
                    parts.append(inline[id(part)])
                    media.append("sha256:" + inline[id(part)].data.hex())
                elif isinstance(part, MediaPart):
                    if not allow_media:
                        raise ApiError(400, "media parts are accepted only on /aotx/v1/requests",
                                       param="messages")
                    kind = (wire.PartKind.IMAGE_DIGEST if part.type == "input_image"
                            else wire.PartKind.AUDIO_DIGEST)
                    parts.append(wire.Part(kind, part.digest_bytes))
                    media.append(part.digest)
                else:
                    try:
                        text = part.text.encode("utf-8")
                    except UnicodeEncodeError:  # a lone surrogate from a JSON \ud800 escape
                        raise ApiError(400, "text is not valid Unicode (lone surrogate)",
                                       param="messages") from None
                    parts.append(wire.Part(wire.PartKind.TEXT, text))
            messages.append(wire.Message(_ROLES[msg.role], tuple(parts)))
        try:
            payload = wire.encode_submission(wire.Submission(tuple(messages), tuple(body.stops)))
        except wire.WireError as exc:
            raise ApiError(exc.status, f"the request does not fit one packet: {exc.message}") from None
        except UnicodeEncodeError:
            raise ApiError(400, "text is not valid UTF-8 (lone surrogate)", param="messages") from None
        limit = body.token_limit or 0
        if limit >= 1 << 32:
            raise ApiError(400, "max_tokens is too large", param="max_tokens")
        flags = 0
        seed = 0
        if body.seed is not None:
            flags |= wire.SUBMIT_FLAG_SEED
            seed = body.seed & ((1 << 64) - 1)
        if body.memory == "off":
            flags |= wire.SUBMIT_FLAG_MEMORY_OFF
        h = wire.Header(op=wire.Op.SUBMIT, principal=principal.id, role=m.role, max_tokens=limit,
                        temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p, submit_flags=flags,
                        seed=seed)
        return h, payload, m, media

    async def submit(self, body: ChatRequest, principal: Principal,
                     allow_media: bool = False) -> tuple[wire.Header, wire.ModelInfo, list[str]]:
        inline = await self.upload_inline(body, principal)
        h, payload, m, media = self.submission(body, principal, allow_media, inline)
        rh, rbody = await self.call(h, payload)
        self.raise_for(rh, rbody, ok=(202,))
        return rh, m, media

    async def admission_body(self, body: ChatRequest, principal: Principal) -> bytes:
        """POST /aotx/v1/requests: admit, and the admission document."""
        if body.stream:
            raise ApiError(400, "stream must be absent or false on /aotx/v1/requests; "
                                "follow GET /aotx/v1/requests/{id}/events instead", param="stream")
        rh, _, media = await self.submit(body, principal, allow_media=True)
        return dumps({"schema": "aotx.admission.v1", "id": self.request_id(rh),
                      "runtime_epoch": str(rh.epoch), "state": "accepted",
                      "persistence": "ephemeral", "media": media})

    async def upload_inline(self, body: ChatRequest, principal: Principal) -> dict[int, wire.Part]:
        """Send OpenAI inline media (``image_url`` data URLs, ``input_audio``) to the device
        as ephemeral sources: leased by this request, removed when it ends."""
        found = [p for msg in body.messages for p in msg.parts()
                 if isinstance(p, ImageUrlPart | InputAudioPart)]
        if not found:
            return {}
        m = self.model_for(body.model, principal)
        out: dict[int, wire.Part] = {}
        for part in found:
            image = isinstance(part, ImageUrlPart)
            if not m.modalities & (wire.MOD_IMAGE if image else wire.MOD_AUDIO):
                raise ApiError(400, f"model {m.alias} does not accept "
                                    f"{'image' if image else 'audio'} input", param="messages")
            ctype, raw = inline_media(part)

            async def one(data: bytes = raw) -> AsyncIterator[bytes]:
                yield data

            _, obj = await MediaUpload(self, principal, wire.CONTENT_TYPES[ctype][0],
                                       ephemeral=True).run(one())
            if obj["state"] == "refused":
                raise ApiError(400, f"inline {obj['kind']} refused: {obj['reason']}",
                               param="messages", code="media_refused")
            out[id(part)] = wire.Part(wire.CONTENT_TYPES[ctype][1], bytes.fromhex(obj["digest"][7:]))
        return out

    async def read(self, principal: Principal, epoch: int, identity: bytes, cursor: int,
                   op: wire.Op = wire.Op.READ, seen: wire.Header | None = None,
                   timeout_ms: int = WAIT_MS) -> tuple[wire.Header, bytes]:
        pid = principal.id
        if op is wire.Op.WAIT and self._over_wait_share(pid):
            # Over its share of parked WAITs: poll with READs (holding no mailbox
            # between them) and answer as the WAIT would, on new bytes, a changed
            # state, or the timeout; or park after all once its share has room.
            deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
            while self._over_wait_share(pid):
                await asyncio.sleep(WAIT_POLL_S)
                rh, body = await self.read(principal, epoch, identity, cursor)
                if (body or rh.total > cursor or seen is None
                        or (rh.phase, rh.cancel_requested) != (seen.phase, seen.cancel_requested)
                        or asyncio.get_running_loop().time() >= deadline):
                    return rh, body
            timeout_ms = max(1, int((deadline - asyncio.get_running_loop().time()) * 1000))
        h = wire.Header(op=op, principal=pid, epoch=epoch, identity=identity, cursor=cursor)
        if op is wire.Op.WAIT:
            h.max_tokens = timeout_ms
            if seen is not None:
                h.phase = seen.phase
                h.cancel_requested = seen.cancel_requested
            self.parked[pid] = self.parked.get(pid, 0) + 1
        try:
            rh, body = await self.call(h, timeout=timeout_ms / 1000 + 30)
        finally:
            if op is wire.Op.WAIT:
                self.parked[pid] -= 1
                if not self.parked[pid]:
                    del self.parked[pid]
        self.raise_for(rh, body)
        return rh, body

    def _over_wait_share(self, pid: int) -> bool:
        if self.info is None:
            return False
        return self.parked.get(pid, 0) >= max(1, int(self.info.mailboxes * WAIT_SHARE))

    async def follow(self, principal: Principal, epoch: int, identity: bytes, cursor: int,
                     first: tuple[wire.Header, bytes] | None = None,
                     ) -> AsyncIterator[tuple[wire.Header, bytes, bool]]:
        """Yield (state, new bytes, changed) until the request is terminal and fully read.

        ``changed`` is True when the state fields differ from the previous
        yield.  A yield with no bytes and no change is a keep-alive tick.
        """
        seen: wire.Header | None = None
        if first is None:
            first = await self.read(principal, epoch, identity, cursor)
        rh, data = first
        while True:
            changed = seen is None or (rh.phase, rh.cancel_requested, rh.finish) != (
                seen.phase, seen.cancel_requested, seen.finish)
            yield rh, data, changed
            cursor += len(data)
            seen = rh
            if wire.Phase(rh.phase).terminal and cursor >= rh.total:
                return
            op = wire.Op.READ if cursor < rh.total else wire.Op.WAIT
            rh, data = await self.read(principal, epoch, identity, cursor, op=op, seen=seen)

    async def window_body(self, principal: Principal, rid: str, cursor: str | None) -> bytes:
        """The aotx.request.v1 document for ``rid`` with the window at ``cursor``."""
        epoch, identity = self.parse_id(rid)
        pos = parse_cursor(cursor)
        rh, data = await self.read(principal, epoch, identity, pos)
        return dumps({"schema": "aotx.request.v1", **self.state_fields(rh),
                      "output": {"encoding": "base64", "bytes": b64(data), "cursor": str(pos),
                                 "next_cursor": str(pos + len(data)),
                                 "total_bytes": str(rh.total)}})

    async def cancel(self, principal: Principal, epoch: int, identity: bytes) -> wire.Header:
        h = wire.Header(op=wire.Op.CANCEL, principal=principal.id, epoch=epoch, identity=identity)
        rh, body = await self.call(h)
        self.raise_for(rh, body, ok=(202,))
        return rh


class MediaUpload:
    """One source sent to the device in MEDIA_PUT chunks of at most a packet's payload.

    Anything but a finished upload (the client went away, a chunk was refused) is
    aborted on the device, so nothing partial is left behind."""

    def __init__(self, g: Gateway, principal: Principal, code: int,
                 ephemeral: bool = False) -> None:
        self.g = g
        self.principal = principal
        self.code = code
        self.flags = wire.MEDIA_FLAG_EPHEMERAL if ephemeral else 0
        self.id = secrets.token_bytes(16)
        self.sent = 0

    async def _put(self, chunk: bytes, flags: int) -> tuple[wire.Header, bytes]:
        h = wire.Header(op=wire.Op.MEDIA_PUT, principal=self.principal.id, identity=self.id,
                        cursor=self.sent, role=self.code, submit_flags=flags | self.flags)
        rh, body = await self.g.call(h, chunk)
        if rh.status not in (200, 201, 202):
            self.g.raise_for(rh, body)
        self.sent += len(chunk)
        return rh, body

    async def run(self, pieces: AsyncIterator[bytes]) -> tuple[int, dict[str, Any]]:
        """Send every piece; returns (201 new or 200 existing, the aotx.media.v1 object)."""
        buf = bytearray()
        finished = False
        try:
            async for piece in pieces:
                buf += piece
                while len(buf) >= wire.MAX_PAYLOAD:
                    chunk = bytes(buf[:wire.MAX_PAYLOAD])
                    del buf[:wire.MAX_PAYLOAD]
                    await self._put(chunk, 0)
            rh, body = await self._put(bytes(buf), wire.MEDIA_FLAG_FINAL)
            finished = True
        finally:
            if not finished:
                with contextlib.suppress(ApiError, asyncio.CancelledError):
                    await asyncio.shield(self._put(b"", wire.MEDIA_FLAG_ABORT))
        return rh.status, _media_json(rh.identity, wire.decode_media_meta(body[:64]),
                                      body[64:].decode())


_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac"}


def inline_media(part: ImageUrlPart | InputAudioPart) -> tuple[str, bytes]:
    """The content type and bytes of an OpenAI inline media part (400 when unusable)."""
    if isinstance(part, ImageUrlPart):
        url = part.image_url.url
        if not url.startswith("data:"):
            raise ApiError(400, "image_url must be a data: URL (data:image/png;base64,...); "
                                "aotx fetches nothing from the network. Or upload the image to "
                                "/aotx/v1/media and name its digest", param="messages")
        head, sep, data = url[5:].partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise ApiError(400, "the image's data: URL must be base64 "
                                "(data:image/png;base64,...)", param="messages")
        ctype = head[:-7].split(";")[0].strip().lower()  # parameters (name=...) ignored
        if not ctype.startswith("image/") or ctype not in wire.CONTENT_TYPES:
            raise ApiError(400, f"unsupported image type {ctype or '(none)'}; use one of "
                                f"{', '.join(t for t in sorted(wire.CONTENT_TYPES) if t.startswith('image/'))}",
                           param="messages")
    else:
        ctype, data = _AUDIO_FORMATS[part.input_audio.format], part.input_audio.data
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "inline media is not valid base64", param="messages") from None
    if not raw:
        raise ApiError(400, "inline media is empty", param="messages")
    return ctype, raw


def _sse(event: str | None, data: bytes, event_id: str | None = None) -> bytes:
    out = b""
    if event:
        out += b"event: " + event.encode() + b"\n"
    if event_id:
        out += b"id: " + event_id.encode() + b"\n"
    return out + b"data: " + data + b"\n\n"


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})
_WINDOW_PATH = re.compile(r"^/aotx/v1/requests/[^/]+$")


class Guard:
    """ASGI middleware in front of every route.

    * While bound to loopback, a Host header naming anything but a loopback
      name is refused with 421 (DNS rebinding: a page from another origin that
      resolves its own name to 127.0.0.1 must not reach the API).
    * Request bodies: at most ``limit`` bytes (413), and each chunk must arrive
      within ``BODY_IDLE_TIMEOUT`` seconds (408), so slow clients cannot hold a
      request open for ever.  Bodies are read in full before the route runs,
      except media uploads, which stream to the device chunk by chunk under the
      same pacing.
    """

    def __init__(self, app: Any, loopback_only: bool, limit: int = MAX_BODY,
                 gateway: Callable[[], Gateway] | None = None) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.limit = limit
        self.gateway = gateway

    @staticmethod
    async def _answer(send: Callable[[dict[str, Any]], Awaitable[None]], status: int,
                      body: Callable[[], Awaitable[bytes]]) -> None:
        """Send ``status`` and the JSON ``body()`` returns, or the standard error object
        of the ApiError it raises (as the app's exception handler would)."""
        headers = [(b"content-type", b"application/json")]
        try:
            out = await body()
        except ApiError as exc:
            status, out = exc.status, dumps(exc.body())
            headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
        headers.append((b"content-length", str(len(out)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    async def _window_fast_path(self, scope: dict[str, Any], send: Callable[
            [dict[str, Any]], Awaitable[None]]) -> None:
        """GET /aotx/v1/requests/{id}: the hottest read, without the framework's layers."""
        assert self.gateway is not None
        g = self.gateway()

        async def window() -> bytes:
            principal = await g.authenticate(Request(scope))
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"),
                             keep_blank_values=True)
            cursor = query.get("cursor", [None])[-1]
            return await g.window_body(principal, scope["path"][len("/aotx/v1/requests/"):],
                                       cursor)

        await self._answer(send, 200, window)

    async def _submit_fast_path(self, scope: dict[str, Any], body: bytes, send: Callable[
            [dict[str, Any]], Awaitable[None]]) -> bool:
        """POST /aotx/v1/requests without the framework's layers (they cost ~40 % of
        the gateway's CPU for an admission).  Only a JSON body that validates is
        answered here; anything else goes on to the route, which answers exactly as
        before (the credentials are still checked first there)."""
        assert self.gateway is not None
        ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
        if ctype.split(b";")[0].strip().lower() != b"application/json":
            return False
        try:
            chat = ChatRequest.model_validate(json.loads(body))  # as FastAPI parses it
        except (ValueError, RecursionError, ValidationError):
            return False
        g = self.gateway()

        async def admit() -> bytes:
            return await g.admission_body(chat, await g.authenticate(Request(scope)))

        await self._answer(send, 202, admit)
        return True

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.loopback_only:
            host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.lower() not in LOOPBACK_HOSTS:
                await self._refuse(send, 421, f"the Host header {host!r} is not a loopback "
                                              "name; this service only answers 127.0.0.1")
                return

        async def paced() -> dict[str, Any]:
            try:
                return await asyncio.wait_for(receive(), BODY_IDLE_TIMEOUT)
            except TimeoutError:
                raise _BodyTimeout() from None

        streamed = (scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS")
                    or scope["path"] == "/aotx/v1/media")
        has_body = any(k == b"transfer-encoding" or (k == b"content-length" and v.strip(b" 0"))
                       for k, v in scope["headers"])
        if (scope["method"] == "GET" and self.gateway is not None and not has_body
                and _WINDOW_PATH.match(scope["path"])):
            await self._window_fast_path(scope, send)
            return
        if streamed:
            inner = paced if scope["method"] == "POST" else receive
            if has_body:
                inner, send = self._close_unless_read(inner, send)
            try:
                await self.app(scope, inner, send)
            except _BodyTimeout:
                await self._refuse(send, 408, "the request body stalled")
            return
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                await self._refuse(send, 413, f"request body exceeds {self.limit} bytes")
                return
        chunks = []
        size = 0
        while True:
            try:
                msg = await paced()
            except _BodyTimeout:
                await self._refuse(send, 408, f"no body bytes for {BODY_IDLE_TIMEOUT:.0f} s")
                return
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send, 413, f"request body exceeds {self.limit} bytes")
                return
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        if (scope["path"] == "/aotx/v1/requests" and scope["method"] == "POST"
                and self.gateway is not None and await self._submit_fast_path(scope, body, send)):
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _close_unless_read(
            receive: Callable[[], Awaitable[dict[str, Any]]],
            send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> tuple[Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]]:
        """For a request with a body the application may not read (a GET with a
        Content-Length, an upload refused before its body): a response that starts
        before the body ended says ``connection: close``.  Kept alive, the connection
        would wait for the rest of that body with no timer running."""
        done = False

        async def tracked() -> dict[str, Any]:
            nonlocal done
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body"):
                done = True
            return msg

        async def closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not done:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"connection" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return tracked, closing

    @staticmethod
    async def _refuse(send: Callable[[dict[str, Any]], Awaitable[None]], status: int,
                      message: str) -> None:
        body = dumps(error_body(status, message))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _BodyTimeout(Exception):
    pass


def create_app(paths: RuntimePaths, loopback_only: bool = True) -> FastAPI:
    gw_holder: dict[str, Gateway] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = Gateway(paths)
        gw_holder["gw"] = gw
        app.state.gateway = gw
        task = asyncio.get_running_loop().create_task(gw.poll_loop())
        yield
        task.cancel()
        await gw.broker.close()

    app = FastAPI(title="aotx", version="0.1.0", lifespan=lifespan,
                  description="Local LLM inference: standard OpenAI routes and the native aotx API.")

    def gw() -> Gateway:
        return gw_holder["gw"]

    async def authenticated(request: Request) -> Principal:
        """Runs before FastAPI validates the body: no token, no validation details."""
        return await gw().authenticate(request)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return Response(dumps(exc.body()), status_code=exc.status, headers=exc.headers,
                        media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the body is not valid JSON", []
        return Response(dumps(error_body(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}",
                                         param=".".join(loc) or None)),
                        status_code=400, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return Response(dumps(error_body(exc.status_code, str(exc.detail))),
                        status_code=exc.status_code, media_type="application/json",
                        headers=getattr(exc, "headers", None))

    # -- health ------------------------------------------------------------------
    @app.get("/healthz", tags=["operations"], response_model=S.Health)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], response_model=S.Ready,
             responses={503: {"model": S.Ready, "description": "not ready"}})
    async def readyz() -> Response:
        g = gw()
        try:
            h, _ = await g.broker.call(wire.Header(op=wire.Op.INFO), timeout=5)
            ok = h.status == 200 and g.info is not None
        except BrokerUnavailable:
            ok = False
        body = {"status": "ready" if ok else "not ready", "runtime_epoch": str(g.epoch)}
        return JSONResponse(body, status_code=200 if ok else 503)

    # -- native routes ---------------------------------------------------------
    @app.post("/aotx/v1/requests", status_code=202, tags=["native"], response_model=S.Admission)
    async def submit(body: ChatRequest,
                     principal: Principal = Depends(authenticated)) -> Response:  # noqa: B008
        # Served by Guard's fast path when the body is valid JSON (same code:
        # Gateway.admission_body); this route documents it and answers the rest.
        return Response(await gw().admission_body(body, principal),
                        status_code=202, media_type="application/json")

    @app.get("/aotx/v1/requests/{rid}", tags=["native"], response_model=S.RequestWindow)
    async def get_request(rid: str, request: Request, cursor: str | None = None) -> Response:
        # Served by Guard's fast path (same code: Gateway.window_body); this route
        # documents it in the OpenAPI document and serves it if the fast path is off.
        g = gw()
        principal = await g.authenticate(request)
        return Response(await g.window_body(principal, rid, cursor),
                        media_type="application/json")

    @app.post("/aotx/v1/requests/{rid}/cancel", status_code=202, tags=["native"],
              response_model=S.RequestState)
    async def cancel_request(rid: str, request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        epoch, identity = g.parse_id(rid)
        rh = await g.cancel(principal, epoch, identity)
        return Response(dumps({"schema": "aotx.request.v1", **g.state_fields(rh)}),
                        status_code=202, media_type="application/json")

    @app.get("/aotx/v1/requests/{rid}/events", tags=["native"], response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "SSE: emission, status and error events"}})
    async def events(rid: str, request: Request, cursor: str | None = None) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        last = request.headers.get("last-event-id")
        if cursor is not None and last is not None:
            raise ApiError(400, "give ?cursor or Last-Event-ID, not both", param="cursor")
        epoch, identity = g.parse_id(rid)
        pos = parse_cursor(cursor)
        if last is not None:
            lid, sep, lcur = last.strip().rpartition(":")
            if not sep or lid != rid:
                raise ApiError(400, "Last-Event-ID does not name this request",
                               param="Last-Event-ID")
            pos = parse_cursor(lcur, "Last-Event-ID")
        first = await g.read(principal, epoch, identity, pos)  # errors become HTTP statuses

        async def stream() -> AsyncIterator[bytes]:
            offset = pos
            try:
                async for rh, data, changed in g.follow(principal, epoch, identity, pos, first):
                    if data:
                        nxt = offset + len(data)
                        yield _sse("emission", dumps({
                            "schema": "aotx.emission.v1", "request_id": rid,
                            "runtime_epoch": str(rh.epoch), "source_kind": "model",
                            "model_role": rh.role, "offset": str(offset),
                            "next_cursor": str(nxt), "encoding": "base64", "bytes": b64(data),
                        }), f"{rid}:{nxt}")
                        offset = nxt
                    terminal = wire.Phase(rh.phase).terminal
                    if terminal and offset >= rh.total:
                        yield _sse("status", dumps({"schema": "aotx.status.v1",
                                                    **g.state_fields(rh)}))
                        return
                    if changed and not terminal:
                        yield _sse("status", dumps({"schema": "aotx.status.v1",
                                                    **g.state_fields(rh)}))
                    elif not data and not changed:
                        yield b": keep-alive\n\n"
            except ApiError as exc:
                yield _sse("error", dumps(exc.body()))

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.post("/aotx/v1/media", status_code=201, tags=["media"], response_model=S.MediaSource,
              responses={200: {"model": S.MediaSource,
                               "description": "the same bytes were already a source"}})
    async def upload_media(request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in wire.CONTENT_TYPES:
            raise ApiError(415, f"unsupported media type {ctype or '(none)'}; use one of "
                                f"{', '.join(sorted(wire.CONTENT_TYPES))}", param="Content-Type")
        try:
            status, obj = await MediaUpload(g, principal, wire.CONTENT_TYPES[ctype][0]).run(
                request.stream())
        except _BodyTimeout:
            # Answered here: raised through the app, Starlette's error middleware would
            # answer 500 before the guard could answer 408.  The upload was aborted.
            raise ApiError(408, f"no body bytes for {BODY_IDLE_TIMEOUT:.0f} s",
                           headers={"Connection": "close"}) from None
        if obj["state"] == "refused":
            raise ApiError(400, f"media source {obj['id']} refused: {obj['reason']}",
                           code="media_refused")
        return Response(dumps(obj), status_code=status, media_type="application/json")

    @app.get("/aotx/v1/media", tags=["media"], response_model=S.MediaList)
    async def list_media(request: Request, cursor: str | None = None,
                         limit: int = 20) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        pos = parse_cursor(cursor)
        if not 1 <= limit <= 500:
            raise ApiError(400, "limit must be between 1 and 500", param="limit")
        rh, body = await g.ask(principal, wire.Op.MEDIA_LIST, cursor=pos, max_tokens=limit)
        rows = wire.decode_media_rows(body)
        return Response(dumps({"schema": "aotx.media_list.v1",
                               "data": [_media_json(sid, meta) for sid, meta in rows],
                               "next_cursor": str(rh.cursor) if rh.cursor else None}),
                        media_type="application/json")

    @app.get("/aotx/v1/media/{sid}", tags=["media"], response_model=S.MediaSource)
    async def get_media(sid: str, request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        rh, body = await g.ask(principal, wire.Op.MEDIA_READ, identity=_parse_source_id(sid))
        return Response(dumps(_media_json(rh.identity, wire.decode_media_meta(body[:64]),
                                          body[64:].decode())), media_type="application/json")

    @app.delete("/aotx/v1/media/{sid}", status_code=204, tags=["media"])
    async def delete_media(sid: str, request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        await g.ask(principal, wire.Op.MEDIA_DELETE, identity=_parse_source_id(sid))
        return Response(status_code=204)

    @app.get("/aotx/v1/policy", tags=["policy"], response_model=S.Policy)
    async def get_policy(request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        rh, body = await g.ask(principal, wire.Op.POLICY)
        return Response(dumps(_policy_json(rh, body)), media_type="application/json")

    @app.post("/aotx/v1/policy", tags=["policy"], response_model=S.Policy)
    async def control_policy(body: PolicyControlBody,
                     principal: Principal = Depends(authenticated)) -> Response:  # noqa: B008
        g = gw()
        action = wire.PolicyAction[body.action.replace("-", "_").upper()]
        expected = int(body.expected_revision)
        if expected >= 1 << 64:
            raise ApiError(400, "expected_revision is out of range", param="expected_revision")
        payload = wire.encode_policy_control(wire.PolicyControl(action, expected))
        await g.ensure_ready()
        rh, rbody = await g.call(wire.Header(op=wire.Op.POLICY, principal=principal.id,
                                             epoch=g.epoch), payload)
        if rh.status == 409 and wire.decode_policy_status(rbody).state is wire.PolicyState.OFF:
            raise ApiError(409, "the resident policy is off: no loaded model is qualified for "
                                "automatic memory")
        if rh.status == 409:
            current = wire.decode_policy_status(rbody).control_revision
            raise ApiError(409, f"stale control revision {expected}; the current one is "
                                f"{current}", param="expected_revision")
        g.raise_for(rh, rbody)
        return Response(dumps(_policy_json(rh, rbody)), media_type="application/json")

    async def memory_call(request: Request, sub: wire.MemoryOp,
                          pending_id: int = 0) -> tuple[wire.Header, bytes]:
        g = gw()
        principal = await g.authenticate(request)
        return await g.ask(principal, wire.Op.MEMORY, role=int(sub), cursor=pending_id)

    @app.get("/aotx/v1/memory", tags=["policy"], response_model=S.Memory)
    async def read_memory(request: Request) -> Response:
        _, body = await memory_call(request, wire.MemoryOp.READ)
        doc = orjson.loads(body)
        return Response(dumps({"schema": "aotx.memory.v1", "generation": str(doc["generation"]),
                               "facts": doc["facts"]}), media_type="application/json")

    @app.delete("/aotx/v1/memory", status_code=204, tags=["policy"])
    async def erase_memory(request: Request) -> Response:
        await memory_call(request, wire.MemoryOp.ERASE)
        return Response(status_code=204)

    @app.get("/aotx/v1/memory/pending", tags=["policy"], response_model=S.MemoryPending)
    async def pending_memory(request: Request) -> Response:
        _, body = await memory_call(request, wire.MemoryOp.PENDING)
        return Response(dumps({"schema": "aotx.memory_pending.v1", "data": orjson.loads(body)}),
                        media_type="application/json")

    @app.post("/aotx/v1/memory/pending/{pid}/{verdict}", tags=["policy"],
              response_model=S.PendingDecision)
    async def decide_pending(pid: str, verdict: str, request: Request) -> Response:
        await gw().authenticate(request)  # before anything about the path is said
        if verdict not in ("approve", "reject"):
            raise ApiError(404, "use .../approve or .../reject")
        if not _CURSOR_RE.fullmatch(pid) or int(pid) >= 1 << 63:
            raise ApiError(404, "no such pending decision")
        sub = wire.MemoryOp.APPROVE if verdict == "approve" else wire.MemoryOp.REJECT
        await memory_call(request, sub, int(pid))
        return Response(dumps({"id": pid, "decision": verdict}), media_type="application/json")

    @app.get("/aotx/v1/capabilities", tags=["native"], response_model=S.Capabilities)
    async def capabilities(request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        await g.ensure_ready()
        info = g.info
        assert info is not None
        return Response(dumps({
            "schema": "aotx.capabilities.v1",
            "runtime_epoch": str(info.epoch),
            "limits": {
                "max_packet_bytes": str(info.max_packet), "max_payload_bytes": str(info.max_payload),
                "window_bytes": str(info.window_bytes), "context_tokens": str(info.context_tokens),
                "output_tokens": str(info.output_tokens),
                "active_requests": str(info.active_requests), "slots": str(info.slots),
                "media_bytes": str(info.media_bytes), "body_bytes": str(MAX_BODY),
                "retention_seconds": str(info.retention_seconds),
                "retention_requests": str(info.retention_requests),
            },
            "models": [_model_entry(m) for m in g.visible_models(principal)],
            # Every native function; false exactly when no route provides it.
            "features": {"requests": True, "windows": True, "events": True, "cancel": True,
                         "media": True, "telemetry": True, "metrics": True, "policy": True,
                         "automatic_memory": any(m.automatic_memory for m in info.models),
                         "shared_operations": False},
            "lineage": ({"kind": "automatic_memory", "path": "memory/"}
                        if any(m.automatic_memory for m in info.models) else None),
        }), media_type="application/json")

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        rh, body = await g.ask(principal, wire.Op.METRICS)
        device = orjson.loads(body)
        bh, bbody = await g.call(wire.Header(op=wire.Op.BROKER_STATS))
        broker = orjson.loads(bbody) if bh.status == 200 else {}
        return Response(render_metrics(device, broker, g.broker.packets_sent),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/aotx/v1/telemetry", tags=["native"], response_model=S.Telemetry)
    async def telemetry(request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        rh, body = await g.ask(principal, wire.Op.TELEMETRY)
        t = wire.decode_telemetry(body)
        return Response(dumps({"schema": "aotx.telemetry.v1", "runtime_epoch": str(rh.epoch),
                               "sample": {"service_allocation_bytes": str(t.allocation_bytes),
                                          "device_tick": str(t.tick),
                                          "device_clock_ns": str(t.clock_ns)},
                               "affect": None, "expression": None}),
                        media_type="application/json")

    # -- standard routes -------------------------------------------------------
    @app.get("/v1/models", tags=["standard"], response_model=S.OpenAIModelList)
    async def list_models(request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        await g.ensure_ready()
        return Response(dumps({"object": "list",
                               "data": [_openai_model(m) for m in g.visible_models(principal)]}),
                        media_type="application/json")

    @app.get("/v1/models/{model_id:path}", tags=["standard"], response_model=S.OpenAIModel)
    async def get_model(model_id: str, request: Request) -> Response:
        g = gw()
        principal = await g.authenticate(request)
        await g.ensure_ready()
        return Response(dumps(_openai_model(g.model_for(model_id, principal))),
                        media_type="application/json")

    @app.post("/v1/chat/completions", tags=["standard"], response_model=S.ChatCompletion,
              responses={200: {"content": {"text/event-stream": {}},
                               "description": "the completion, or with stream: true an SSE "
                                              "stream of chat.completion.chunk objects"}})
    async def chat_completions(body: ChatRequest,
                     principal: Principal = Depends(authenticated)) -> Response:  # noqa: B008
        g = gw()
        rh, m, _ = await g.submit(body, principal)
        rid = g.request_id(rh)
        created = int(time.time())
        cid = "chatcmpl-" + rid[4:]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_chat_stream(g, principal, rh, m, cid, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store", "X-Request-Id": rid})
        done = False
        try:
            chunks = []
            last = rh
            async for last, data, _ in g.follow(principal, rh.epoch, rh.identity, 0):  # noqa: B007
                chunks.append(data)
            done = True
        finally:
            if not done:
                await _cancel_quietly(g, principal, rh)
        text = b"".join(chunks).decode("utf-8", errors="replace")
        if last.phase == wire.Phase.FAILED:
            raise ApiError(last.failure or 500, _FAILURES.get(last.failure, "the request failed"))
        return Response(dumps({
            "id": cid, "object": "chat.completion", "created": created, "model": m.alias,
            "system_fingerprint": f"aotx-{rh.epoch}",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None,
                         "finish_reason": _FINISH_NAMES[wire.Finish(last.finish)] or "stop"}],
            "usage": {"prompt_tokens": last.prompt_tokens,
                      "completion_tokens": last.sampled_tokens,
                      "total_tokens": last.prompt_tokens + last.sampled_tokens},
        }), media_type="application/json", headers={"X-Request-Id": rid})

    from starlette.staticfiles import StaticFiles

    # The web console: static files shipped in the package (no CDN). They hold no
    # secret; every API call the page makes carries the token the user typed.
    app.mount("/console", StaticFiles(directory=os.path.join(os.path.dirname(__file__),
                                                             "console"), html=True),
              name="console")
    _document_errors(app)
    return Guard(app, loopback_only, gateway=gw)  # type: ignore[return-value]


async def _cancel_quietly(g: Gateway, principal: Principal, rh: wire.Header) -> None:
    """Cancel on the device even while this task is being cancelled (client gone)."""
    task = asyncio.ensure_future(g.cancel(principal, rh.epoch, rh.identity))
    try:
        await asyncio.shield(task)
    except (ApiError, asyncio.CancelledError):
        pass


async def _chat_stream(g: Gateway, principal: Principal, rh: wire.Header, m: wire.ModelInfo,
                       cid: str, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": m.alias, "system_fingerprint": f"aotx-{rh.epoch}",
                               "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return b"data: " + dumps(obj) + b"\n\n"

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    done = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        last = rh
        async for last, data, _ in g.follow(principal, rh.epoch, rh.identity, 0):  # noqa: B007
            text = decoder.decode(data)
            if text:
                yield chunk({"content": text})
        tail = decoder.decode(b"", final=True)
        if tail:
            yield chunk({"content": tail})
        done = True
        if last.phase == wire.Phase.FAILED:
            err = error_body(last.failure or 500, _FAILURES.get(last.failure, "the request failed"))
            yield b"data: " + dumps(err) + b"\n\n"
        else:
            yield chunk({}, _FINISH_NAMES[wire.Finish(last.finish)] or "stop")
            if include_usage:
                yield b"data: " + dumps({
                    "id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": m.alias, "system_fingerprint": f"aotx-{rh.epoch}", "choices": [],
                    "usage": {"prompt_tokens": last.prompt_tokens,
                              "completion_tokens": last.sampled_tokens,
                              "total_tokens": last.prompt_tokens + last.sampled_tokens}}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield b"data: " + dumps(exc.body()) + b"\n\n"
    finally:
        if not done:
            await _cancel_quietly(g, principal, rh)


def render_metrics(device: dict[str, Any], broker: dict[str, Any], gateway_packets: int) -> bytes:
    """Prometheus text exposition of the device's and the broker's counters."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Snapshot:
        def collect(self) -> Any:
            g = GaugeMetricFamily("aotx_requests", "Requests held by the device, by state",
                                  labels=["state"])
            for state, n in sorted(device["requests_by_state"].items()):
                g.add_metric([state], n)
            yield g
            c = CounterMetricFamily("aotx_requests_admitted", "Requests admitted this epoch")
            c.add_metric([], device["admitted"])
            yield c
            c = CounterMetricFamily("aotx_requests_refused", "Submissions refused, by status",
                                    labels=["status"])
            for status, n in sorted(device["refused"].items()):
                c.add_metric([status], n)
            yield c
            fams = {
                "prompt": CounterMetricFamily("aotx_prompt_tokens", "Prompt tokens evaluated",
                                              labels=["model"]),
                "completion": CounterMetricFamily("aotx_completion_tokens", "Tokens generated",
                                                  labels=["model"]),
                "steps": CounterMetricFamily("aotx_scheduler_steps", "Decode steps (device tick)",
                                             labels=["model"]),
                "queue": GaugeMetricFamily("aotx_queue_depth", "Requests waiting for a slot",
                                           labels=["model"]),
                "slots": GaugeMetricFamily("aotx_active_slots", "Sequences in the batch",
                                           labels=["model"]),
                "finished": CounterMetricFamily("aotx_requests_finished", "Requests that ended",
                                                labels=["model", "state"]),
            }
            hists = []
            for alias, m in sorted(device["models"].items()):
                fams["prompt"].add_metric([alias], m["prompt_tokens"])
                fams["completion"].add_metric([alias], m["completion_tokens"])
                fams["steps"].add_metric([alias], m["steps"])
                fams["queue"].add_metric([alias], m["queue_depth"])
                fams["slots"].add_metric([alias], m["active_slots"])
                for state, n in sorted(m["finished"].items()):
                    fams["finished"].add_metric([alias, state], n)
                for name, key, doc in (("aotx_time_to_first_token_seconds", "ttft_seconds",
                                        "Admission to first token"),
                                       ("aotx_inter_token_seconds", "inter_token_seconds",
                                        "Time between tokens of one request")):
                    h = m[key]
                    acc = 0
                    buckets = []
                    for le, n in zip([*map(str, h["buckets"]), "+Inf"], h["counts"], strict=True):
                        acc += n
                        buckets.append((le, acc))
                    fam = HistogramMetricFamily(name, doc, labels=["model"])
                    fam.add_metric([alias], buckets, h["sum"])
                    hists.append(fam)
            yield from fams.values()
            yield from hists
            g = GaugeMetricFamily("aotx_mailboxes", "Broker mailboxes by use", labels=["use"])
            for use in ("free", "in_flight", "orphaned"):
                g.add_metric([use], broker.get(use, 0))
            yield g
            c = CounterMetricFamily("aotx_broker_packets", "Packets relayed by the broker",
                                    labels=["kind"])
            for kind in ("packets", "replies", "dropped", "busy"):
                c.add_metric([kind], broker.get(kind, 0))
            yield c
            c = CounterMetricFamily("aotx_gateway_packets", "Packets sent by this gateway")
            c.add_metric([], gateway_packets)
            yield c
            g = GaugeMetricFamily("aotx_media_bytes", "Bytes held by media sources")
            g.add_metric([], device.get("media_bytes", 0))
            yield g
            g = GaugeMetricFamily("aotx_service_allocation_bytes", "Bytes the runtime allocated")
            g.add_metric([], device.get("allocation_bytes", 0))
            yield g

    registry = CollectorRegistry()
    registry.register(Snapshot())  # type: ignore[arg-type]
    return bytes(generate_latest(registry))


#: Statuses any authenticated route can answer (see docs/api.md for which and why).
_COMMON_ERRORS = (400, 401, 403, 404, 405, 408, 409, 410, 413, 415, 421, 422, 429, 431, 503)
_PUBLIC = ("/healthz", "/readyz", "/openapi.json", "/docs", "/redoc")


def _document_errors(app: FastAPI) -> None:
    """Declare the standard error responses on every route of the OpenAPI document."""
    for route in app.routes:
        if not isinstance(route, APIRoute) or route.path in _PUBLIC:
            continue
        for status in _COMMON_ERRORS:
            route.responses.setdefault(status, {"model": S.ErrorResponse,
                                                "description": "standard error object"})
        if "POST" in route.methods:
            route.responses.setdefault(200, {"description": "OK"})
            route.responses.setdefault(201, {"description": "Created"})
            route.responses.setdefault(202, {"description": "Accepted"})
        if "DELETE" in route.methods:
            route.responses.setdefault(204, {"description": "Removed"})
    app.openapi_schema = None


def _policy_json(h: wire.Header, body: bytes) -> dict[str, Any]:
    st = wire.decode_policy_status(body)
    return {"schema": "aotx.policy.v1", "runtime_epoch": str(h.epoch),
            "mode": "automatic_memory" if st.mode == 1 else str(st.mode), "abi": st.abi,
            "state": st.state.name.lower(), "review_enabled": bool(st.review_enabled),
            "pending": st.pending, "active_rows": st.active_rows,
            "result_status": st.result_status, "control_revision": str(st.control_revision),
            "source_frontier": str(st.source_frontier), "completed": str(st.completed),
            "interrupted": str(st.interrupted), "refused": str(st.refused),
            "decision": str(st.decision), "saved_generation": str(st.saved_generation),
            "max_ns": str(st.max_ns), "last_ns": str(st.last_ns),
            "written_bytes": str(st.written_bytes), "result_bytes": str(st.result_bytes),
            "reason": st.reason.name.lower()}


def _parse_source_id(sid: str) -> bytes:
    if len(sid) != 36 or not sid.startswith("src-") or not set(sid[4:]) <= set("0123456789abcdef"):
        raise ApiError(404, "no such media source")
    return bytes.fromhex(sid[4:])


def _media_json(source_id: bytes, meta: wire.MediaMeta, reason: str = "") -> dict[str, Any]:
    return {"schema": "aotx.media.v1", "id": f"src-{source_id.hex()}",
            "digest": f"sha256:{meta.digest.hex()}",
            "kind": "image" if meta.kind is wire.PartKind.IMAGE_DIGEST else "audio",
            "content_type": wire.MEDIA_TYPES[meta.content_type], "bytes": str(meta.size),
            "state": meta.state.name.lower(), "reason": reason or None, "leases": meta.leases,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(meta.created_ms / 1000))}


def _model_entry(m: wire.ModelInfo) -> dict[str, Any]:
    return {"alias": m.alias, "role": m.role, "model_sha256": m.sha256.hex(),
            "input_modalities": wire.modality_names(m.modalities),
            "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.published_at)),
            "context_tokens": str(m.context_tokens), "automatic_memory": m.automatic_memory}


def _openai_model(m: wire.ModelInfo) -> dict[str, Any]:
    return {"id": m.alias, "object": "model", "created": m.published_at, "owned_by": "aotx",
            "automatic_memory": m.automatic_memory}


def run(paths: RuntimePaths, host: str, port: int) -> None:
    import uvicorn

    paths.ensure()
    ensure_admin_token(paths.admin_token)
    loopback = host in ("127.0.0.1", "localhost", "::1")
    app = create_app(paths, loopback_only=loopback)
    if not loopback:
        log.warning("event=gateway.public_bind host=%s: the gateway is reachable from other "
                    "machines; every route still needs a bearer token", host)
    log.info("event=gateway.listening url=http://%s:%d", host, port)
    url_host = f"[{host}]" if ":" in host else host
    with open(os.path.join(paths.run_dir, "gateway.url"), "w") as f:
        f.write(f"http://{url_host}:{port}\n")
    request_short_slice()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            loop="uvloop", http=GuardedHttpToolsProtocol,
                            timeout_graceful_shutdown=3, server_header=False)
    uvicorn.Server(config).run()
