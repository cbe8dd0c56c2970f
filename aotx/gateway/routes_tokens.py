"""The token routes: llama-server's ``/tokenize``, ``/detokenize`` and
``/apply-template``, and the input-token counts of a chat body
(``/v1/chat/completions/input_tokens``; the Responses and Messages routes have theirs).

Each is a dry run on the device (gateway/dry.py): the same grant, model mask, template
and tokenizer as the request the body would make, so a count is the ``prompt_tokens``
that the request's usage reports.  ``model`` may be left out of llama-server's three
when the caller sees one text model (llama-server serves one).
"""

from __future__ import annotations

import struct
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import Field

from .. import wire
from . import calls, dry
from .body import Body
from .errors import ApiError, Call, refusal
from .render import json_response
from .requests import ChatRequest, TextPart
from .service import Caller, Gateway, Principal, Service

router = APIRouter(tags=["tokens"], redirect_slashes=False)
#: Token ids in one /detokenize packet (its payload's room, with the envelope's bytes).
IDS_PER_PACKET = (wire.MAX_PAYLOAD - 256) // 4
MAX_IDS = 1 << 20


class TokenizeRequest(Body):
    model: str | None = Field(default=None, min_length=1, max_length=256)
    content: str
    add_special: bool = False  # the BOS (and EOS) the model adds to a prompt
    parse_special: bool = True  # special-token texts become those tokens
    with_pieces: bool = False


class DetokenizeRequest(Body):
    model: str | None = Field(default=None, min_length=1, max_length=256)
    tokens: list[int] = Field(max_length=MAX_IDS)


class TemplateRequest(ChatRequest):
    """A chat body whose ``model`` may be left out (llama-server's /apply-template)."""

    model: str | None = Field(default=None, min_length=1, max_length=256)  # type: ignore[assignment]


def text_model(g: Gateway, alias: str | None, principal: Principal) -> wire.ModelInfo:
    """The model named, or the caller's one text model when none is."""
    if alias is not None:
        return calls.chat_model(g, alias, principal)
    models = [m for m in g.visible_models(principal) if m.context_tokens]
    if len(models) != 1:
        raise ApiError(400, f"model is required: this caller may use {len(models)} text "
                            "models", param="model")
    return models[0]


def _raw(m: wire.ModelInfo, principal: Principal, part: wire.Part, flags: int
         ) -> tuple[wire.Header, bytes, Call]:
    """A raw dry SUBMIT of one part (text, or token ids)."""
    try:
        payload = wire.encode_submission(wire.Submission(
            (wire.Message(wire.Role.USER, (part,)),)))
    except wire.WireError as exc:
        raise refusal(wire.Header().refuse(exc.status, exc.reason, exc.detail)) from None
    h = wire.Header.request(wire.Op.SUBMIT, principal=principal.id, role=m.role,
                            submit_flags=wire.SUBMIT_FLAG_RAW | flags)
    return h, payload, Call(m.alias, input_bytes=len(payload))


def piece_json(data: bytes) -> str | list[int]:
    """llama-server's piece: its text, or its bytes when they are not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, principal: Principal = Caller,
                   g: Gateway = Service) -> Response:
    await g.ensure_ready()
    m = text_model(g, body.model, principal)
    flags = ((0 if body.add_special else wire.SUBMIT_DRY_BARE)
             | (wire.SUBMIT_DRY_SPECIAL if body.parse_special else 0))
    try:
        text = body.content.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "content is not valid Unicode (lone surrogate)",
                       param="content") from None
    h, payload, call = _raw(m, principal, wire.Part(wire.PartKind.TEXT, text), flags)
    if body.with_pieces:
        _, pages = await dry.pages(g, principal, h, payload, call, wire.SUBMIT_DRY_PIECES)
        tokens: list[Any] = [{"id": t, "piece": piece_json(p)} for page in pages
                             for t, p in wire.decode_pieces(page)]
    else:
        _, pages = await dry.pages(g, principal, h, payload, call, wire.SUBMIT_DRY_TOKENS)
        data = b"".join(pages)
        tokens = list(struct.unpack(f"<{len(data) // 4}i", data))
    return json_response({"tokens": tokens})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, principal: Principal = Caller,
                     g: Gateway = Service) -> Response:
    """The tokens' bytes joined (a special token's text included), as UTF-8."""
    await g.ensure_ready()
    m = text_model(g, body.model, principal)
    if any(not 0 <= t < 1 << 31 for t in body.tokens):
        raise ApiError(400, "tokens must be token ids from 0", param="tokens")
    out = bytearray()
    for i in range(0, len(body.tokens), IDS_PER_PACKET):
        ids = body.tokens[i:i + IDS_PER_PACKET]
        part = wire.Part(wire.PartKind.TOKENS, struct.pack(f"<{len(ids)}I", *ids))
        h, payload, call = _raw(m, principal, part, 0)
        try:
            _, pages = await dry.pages(g, principal, h, payload, call, wire.SUBMIT_DRY_PIECES)
        except ApiError as exc:
            if exc.param == "prompt":
                exc.param, exc.message = "tokens", exc.message.replace("the prompt", "tokens")
            raise
        out += b"".join(p for page in pages for _, p in wire.decode_pieces(page))
    return json_response({"content": out.decode("utf-8", errors="replace")})


@router.post("/apply-template")
async def apply_template(body: TemplateRequest, principal: Principal = Caller,
                         g: Gateway = Service) -> Response:
    """The chat template's rendering of the body: the text the model would read
    (the tools, and automatic memory's facts, where the request would have them)."""
    await g.ensure_ready()
    body.model = text_model(g, body.model, principal).alias
    if any(not isinstance(p, TextPart) for m in body.messages for p in m.parts()):
        # (an inline image would be an upload for one page of the answer)
        raise ApiError(400, "/apply-template renders text messages; count media with the "
                            "input_tokens routes", param="messages")
    _, h, payload, call = await calls.prepare(g, body, principal, allow_media=False)
    _, pages = await dry.pages(g, principal, h, payload, call, wire.SUBMIT_DRY_TEXT)
    return json_response({"prompt": b"".join(pages).decode("utf-8", errors="replace")})


async def input_tokens(g: Gateway, body: ChatRequest, principal: Principal,
                       allow_media: bool = False) -> int:
    """The prompt tokens of the request ``body`` would make (media included;
    ``allow_media``: media sources named by digest, as the route that runs it takes)."""
    _, h, payload, call = await calls.prepare(g, body, principal, allow_media)
    rh, _, _ = await dry.once(g, principal, dry.dry(h), payload, call)
    return rh.prompt_tokens


@router.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatRequest, principal: Principal = Caller,
                            g: Gateway = Service) -> Response:
    n = await input_tokens(g, body, principal)
    return json_response({"object": "response.input_tokens", "input_tokens": n})
