"""Media bytes to the device: an upload in MEDIA_PUT chunks, and OpenAI's inline media
(``image_url`` data URLs, ``input_audio``) sent as ephemeral sources of one request."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .. import wire
from .errors import ApiError
from .render import media_json
from .requests import ChatRequest, ImageUrlPart, InputAudioPart

if TYPE_CHECKING:
    from .service import Gateway, Principal

_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac"}
#: Content-Type -> (the wire's content type code, the part kind naming such a source).
CONTENT_TYPES: dict[str, tuple[int, wire.PartKind]] = {
    ct: (code, wire.media_kind(code)) for code, ct in wire.MEDIA_TYPES.items()}
for _alias, _ct in (("audio/x-wav", "audio/wav"), ("audio/wave", "audio/wav"),
                    ("audio/mp3", "audio/mpeg"), ("audio/x-flac", "audio/flac")):
    CONTENT_TYPES[_alias] = CONTENT_TYPES[_ct]  # names some clients send


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
        h = wire.Header.request(wire.Op.MEDIA_PUT, principal=self.principal.id,
                                upload_id=self.id, cursor=self.sent, content_type=self.code,
                                media_flags=flags | self.flags)
        rh, body = await self.g.ask(h, chunk, ok=(200, 201, 202))
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
        return rh.status, media_json(rh, wire.decode_media_meta(body))


async def upload_inline(g: Gateway, body: ChatRequest, m: wire.ModelInfo,
                        principal: Principal) -> dict[int, wire.Part]:
    """Send the request's inline media to the device as ephemeral sources: leased by this
    request, removed when it ends.  Returns each part's digest part, by ``id(part)``."""
    out: dict[int, wire.Part] = {}
    for msg in body.messages:
        for part in msg.parts():
            if not isinstance(part, ImageUrlPart | InputAudioPart):
                continue
            image = isinstance(part, ImageUrlPart)
            if not m.modalities & (wire.MOD_IMAGE if image else wire.MOD_AUDIO):
                raise ApiError(400, f"model {m.alias} does not accept "
                                    f"{'image' if image else 'audio'} input", param="messages")
            ctype, raw = inline_media(part)

            async def one(data: bytes = raw) -> AsyncIterator[bytes]:
                yield data

            code, kind = CONTENT_TYPES[ctype]
            _, obj = await MediaUpload(g, principal, code, ephemeral=True).run(one())
            if obj["state"] == "refused":
                raise ApiError(400, f"inline {obj['kind']} refused: {obj['reason']}",
                               param="messages", code="media_refused")
            out[id(part)] = wire.Part(kind, bytes.fromhex(obj["digest"][7:]))
    return out


def inline_media(part: ImageUrlPart | InputAudioPart) -> tuple[str, bytes]:
    """The content type and bytes of an OpenAI inline media part (400 when unusable)."""
    if isinstance(part, ImageUrlPart):
        ctype, data = _data_url(part.image_url.url)
    else:
        ctype, data = _AUDIO_FORMATS[part.input_audio.format], part.input_audio.data
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "inline media is not valid base64", param="messages") from None
    if not raw:
        raise ApiError(400, "inline media is empty", param="messages")
    return ctype, raw


def _data_url(url: str) -> tuple[str, str]:
    if not url.startswith("data:"):
        raise ApiError(400, "image_url must be a data: URL (data:image/png;base64,...); "
                            "aotx fetches nothing from the network. Or upload the image to "
                            "/aotx/v1/media and name its digest", param="messages")
    head, sep, data = url[5:].partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise ApiError(400, "the image's data: URL must be base64 (data:image/png;base64,...)",
                       param="messages")
    ctype = head[:-7].split(";")[0].strip().lower()  # parameters (name=...) ignored
    if not ctype.startswith("image/") or ctype not in CONTENT_TYPES:
        images = ", ".join(t for t in sorted(CONTENT_TYPES) if t.startswith("image/"))
        raise ApiError(400, f"unsupported image type {ctype or '(none)'}; use one of {images}",
                       param="messages")
    return ctype, data
