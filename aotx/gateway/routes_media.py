"""Reusable media sources: upload, list, read and remove the caller's own sources."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import wire
from . import schemas as S
from .calls import parse_cursor
from .errors import ApiError
from .guard import BodyTimeout
from .render import json_response, media_json, media_row
from .service import Caller, Gateway, Principal, Service
from .uploads import CONTENT_TYPES, MediaUpload

router = APIRouter(tags=["media"], redirect_slashes=False)


def parse_source_id(sid: str) -> bytes:
    if len(sid) != 36 or not sid.startswith("src-") or not set(sid[4:]) <= set("0123456789abcdef"):
        raise ApiError(404, "no such media source")
    return bytes.fromhex(sid[4:])


@router.post("/aotx/v1/media", status_code=201, response_model=S.MediaSource,
             responses={200: {"model": S.MediaSource,
                              "description": "the same bytes were already a source"}})
async def upload_media(request: Request, principal: Principal = Caller,
                       g: Gateway = Service) -> Response:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in CONTENT_TYPES:
        raise ApiError(415, f"unsupported media type {ctype or '(none)'}; use one of "
                            f"{', '.join(sorted(CONTENT_TYPES))}", param="Content-Type")
    declared = request.headers.get("content-length", "")
    limit = g.info.media_bytes if g.info is not None else 0  # (0: not known yet)
    if limit and declared.isdigit() and int(declared) > limit:
        # said before the first byte: refused before it, not after 64 MiB of it
        raise ApiError(413, f"a media source may have at most {limit} bytes",
                       headers={"Connection": "close"})
    try:
        status, obj = await MediaUpload(g, principal, CONTENT_TYPES[ctype][0]).run(
            request.stream())
    except BodyTimeout:
        # Answered here: raised through the app, Starlette's error middleware would answer
        # 500 before the guard could answer 408.  The upload was aborted.
        raise ApiError(408, f"no body bytes for {g.settings.body_timeout:.0f} s",
                       headers={"Connection": "close"}) from None
    if obj["state"] == "refused":
        raise ApiError(400, f"media source {obj['id']} refused: {obj['reason']}",
                       code="media_refused")
    return json_response(obj, status)


@router.get("/aotx/v1/media", response_model=S.MediaList)
async def list_media(cursor: str | None = None, limit: int = 20, principal: Principal = Caller,
                     g: Gateway = Service) -> Response:
    pos = parse_cursor(cursor, what="list position (a next_cursor)")
    if not 1 <= limit <= 500:
        raise ApiError(400, "limit must be between 1 and 500", param="limit")
    rh, body = await g.ask(wire.Header.request(wire.Op.MEDIA_LIST, principal=principal.id,
                                               cursor=pos, max_rows=limit))
    rows = wire.decode_media_rows(body)
    return json_response({"schema": "aotx.media_list.v1",
                          "data": [media_row(sid, meta) for sid, meta in rows],
                          "next_cursor": str(rh.next_position) if rh.next_position else None})


@router.get("/aotx/v1/media/{sid}", response_model=S.MediaSource)
async def get_media(sid: str, principal: Principal = Caller, g: Gateway = Service) -> Response:
    rh, body = await g.ask(wire.Header(op=wire.Op.MEDIA_READ, principal=principal.id,
                                       identity=parse_source_id(sid)))
    return json_response(media_json(rh, wire.decode_media_meta(body)))


@router.delete("/aotx/v1/media/{sid}", status_code=204)
async def delete_media(sid: str, principal: Principal = Caller,
                       g: Gateway = Service) -> Response:
    await g.ask(wire.Header(op=wire.Op.MEDIA_DELETE, principal=principal.id,
                            identity=parse_source_id(sid)))
    return Response(status_code=204)
