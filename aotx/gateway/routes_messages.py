"""Anthropic's Messages API: ``POST /v1/messages`` (whole, or streamed as Anthropic's
events) and ``POST /v1/messages/count_tokens`` (their errors are put in Anthropic's envelope by
the guard: ``anthropic.enveloped``).

A message is a chat completion's device request (gateway/anthropic.py maps the body),
followed by a :class:`~aotx.gateway.choices.ChoiceText` as a chat choice is: its text,
and its tool calls parsed at the end.  A stream is ``message_start``, ``ping``, each
content block's ``content_block_start``, deltas (``text_delta``, ``input_json_delta``)
and ``content_block_stop``, then ``message_delta`` (``stop_reason``, usage) and
``message_stop``; a ``ping`` while the request waits for its model's load; an
``error`` event when it fails.  A client that leaves cancels the request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .. import ids, wire
from . import anthropic as A
from . import calls, choices, routes_tokens
from .errors import ApiError
from .render import dumps, json_response
from .service import Caller, Gateway, Principal, Service, until_disconnected

log = logging.getLogger("aotx.gateway")
router = APIRouter(tags=["anthropic"], redirect_slashes=False)
_SSE: dict[int | str, dict[str, Any]] = {200: {
    "content": {"text/event-stream": {}},
    "description": "the message, or with stream: true Anthropic's SSE events"}}


@router.post("/v1/messages", responses=_SSE)
async def create_message(body: A.MessagesRequest, request: Request,
                         principal: Principal = Caller, g: Gateway = Service) -> Response:
    await g.ensure_ready()
    caps = (g.info.output_tokens if g.info else 0,
            principal.grant.limits.get("output_tokens", 0))
    try:
        chat = body.chat_request(min((c for c in caps if c), default=0))
        admitted = await calls.submit(g, chat, principal)
    except ApiError as exc:
        raise A.reworded(exc) from None
    rh = admitted.header
    rid = ids.format_request_id(rh.epoch, rh.identity)
    if body.metadata is not None and body.metadata.user_id is not None:
        log.debug("event=message.user id=%s user=%r", rid, body.metadata.user_id)
    text = choices.ChoiceText(g, principal, rh, False, chat.tool_mode)
    head = {"id": "msg_" + rid[4:], "type": "message", "role": "assistant",
            "model": admitted.model.alias}
    headers = {"X-Request-Id": rid}
    if body.stream:
        return StreamingResponse(_stream(text, head, body.stop_sequences,
                                         body.omits_thinking),
                                 media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-store"})
    done = False
    try:
        got = await until_disconnected(request, text.whole())
        done = True
    finally:
        if not done:  # (the client left, or the route failed)
            await calls.cancel_quietly(g, principal, rh)
    last = text.last
    if last.phase == wire.Phase.FAILED:
        raise await g.failure(last)
    reason, sequence = A.stop_reason(got["finish_reason"], last.stop_hit, body.stop_sequences)
    return json_response({**head, "content": A.content(got["message"], body.omits_thinking),
                          "stop_reason": reason,
                          "stop_sequence": sequence,
                          "usage": A.usage(last.prompt_tokens, last.sampled_tokens)},
                         headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: A.CountRequest, principal: Principal = Caller,
                       g: Gateway = Service) -> Response:
    """The prompt tokens of the message the body would create (a dry run): the
    ``input_tokens`` its usage reports."""
    try:
        n = await routes_tokens.input_tokens(g, body.chat(), principal)
    except ApiError as exc:
        raise A.reworded(exc) from None
    return json_response({"input_tokens": n})


def _event(kind: str, **data: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **data}) + b"\n\n"


class _Blocks:
    """The content blocks of a stream: which is open, and the events that open and
    close them.  ``omit``: a thinking block opens and closes without its text."""

    def __init__(self, omit: bool = False) -> None:
        self.index = -1
        self.open: str | None = None
        self.omit = omit

    def start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = kind
        return [*out, _event("content_block_start", index=self.index, content_block=block)]

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta (thinking, text, or a tool call's start or
        arguments)."""
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self.start("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
            if not self.omit:
                out.append(_event("content_block_delta", index=self.index, delta={
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self.start("text", {"type": "text", "text": ""})
            out.append(_event("content_block_delta", index=self.index,
                              delta={"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            f = call["function"]
            if "id" in call:
                out += self.start("tool_use", {"type": "tool_use", "id": call["id"],
                                               "name": f["name"], "input": {}})
            if f.get("arguments"):
                out.append(_event("content_block_delta", index=self.index, delta={
                    "type": "input_json_delta", "partial_json": f["arguments"]}))
        return out


async def _stream(text: choices.ChoiceText, head: dict[str, Any], stops: list[str] | None,
                  omit: bool) -> AsyncIterator[bytes]:
    blocks = _Blocks(omit)
    done = False
    try:
        yield _event("message_start", message={
            **head, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": A.usage(text.rh.prompt_tokens, 0)})
        yield _event("ping")
        async for event in text.events():
            if event is choices.WAITING:  # the model loads: the stream is alive
                yield _event("ping")
                continue
            delta, _, finish = event
            for chunk in blocks.delta(delta):
                yield chunk
            if finish is None:
                continue
            for chunk in blocks.stop():
                yield chunk
            last = text.last
            reason, sequence = A.stop_reason(finish, last.stop_hit, stops)
            yield _event("message_delta", delta={"stop_reason": reason,
                                                 "stop_sequence": sequence},
                         usage={"input_tokens": last.prompt_tokens,
                                "output_tokens": last.sampled_tokens})
            yield _event("message_stop")
            done = True
        if not done and text.last.phase == wire.Phase.FAILED:
            raise await text.g.failure(text.last)
    except ApiError as exc:
        yield _event("error", error=A.error_envelope(exc.status, exc.body())["error"])
    finally:
        if not done:
            await calls.cancel_quietly(text.g, text.principal, text.rh)
