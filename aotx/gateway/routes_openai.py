"""The standard (OpenAI-compatible) routes: models and chat completions.

A standard request is a device request like any other; the gateway follows it to the
end and decodes its bytes as UTF-8 (incrementally, for streams).  A standard stream
whose client disconnects is cancelled on the device.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from .. import ids, wire
from . import calls
from . import schemas as S
from .errors import ApiError, wording
from .render import FINISH_NAMES, json_response, openai_model, sse_data, usage
from .requests import ChatRequest
from .service import Caller, Gateway, Principal, Service

router = APIRouter(tags=["standard"], redirect_slashes=False)


@router.get("/v1/models", response_model=S.OpenAIModelList)
async def list_models(principal: Principal = Caller, g: Gateway = Service) -> Response:
    await g.ensure_ready()
    return json_response({"object": "list",
                          "data": [openai_model(m) for m in g.visible_models(principal)]})


@router.get("/v1/models/{model_id:path}", response_model=S.OpenAIModel)
async def get_model(model_id: str, principal: Principal = Caller,
                    g: Gateway = Service) -> Response:
    await g.ensure_ready()
    return json_response(openai_model(g.model_for(model_id, principal)))


def _failed(h: wire.Header) -> ApiError:
    """A request that failed on the device, as the standard routes answer it (its failure
    status, 500 or 503)."""
    message, code, _ = wording(h)
    return ApiError(h.failure or 500, message, code=code)


@router.post("/v1/chat/completions", response_model=S.ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "the completion, or with stream: true an SSE "
                                             "stream of chat.completion.chunk objects"}})
async def chat_completions(body: ChatRequest, principal: Principal = Caller,
                           g: Gateway = Service) -> Response:
    a = await calls.submit(g, body, principal)
    rh = a.header
    rid = ids.format_request_id(rh.epoch, rh.identity)
    chat = Chat("chatcmpl-" + rid[4:], int(time.time()), a.model.alias, rh)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(g, principal, chat, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Request-Id": rid})
    done = False
    try:
        chunks = []
        last = rh
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            chunks.append(data)
        done = True
    finally:
        if not done:
            await calls.cancel_quietly(g, principal, rh)
    if last.phase == wire.Phase.FAILED:
        raise _failed(last)
    text = b"".join(chunks).decode("utf-8", errors="replace")
    return json_response({
        **chat.head("chat.completion"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None,
                     "finish_reason": FINISH_NAMES[wire.Finish(last.finish)] or "stop"}],
        "usage": usage(last),
    }, headers={"X-Request-Id": rid})


class Chat:
    """What every object of one completion repeats."""

    def __init__(self, cid: str, created: int, model: str, admitted: wire.Header) -> None:
        self.cid, self.created, self.model, self.admitted = cid, created, model, admitted

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.cid, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": f"aotx-{self.admitted.epoch}"}

    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              include_usage: bool = False) -> bytes:
        obj = {**self.head("chat.completion.chunk"),
               "choices": [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return sse_data(obj)


async def _chat_stream(g: Gateway, principal: Principal, chat: Chat,
                       include_usage: bool) -> AsyncIterator[bytes]:
    rh = chat.admitted
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    done = False
    try:
        yield chat.chunk({"role": "assistant", "content": ""}, include_usage=include_usage)
        last = rh
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            text = decoder.decode(data)
            if text:
                yield chat.chunk({"content": text}, include_usage=include_usage)
        tail = decoder.decode(b"", final=True)
        if tail:
            yield chat.chunk({"content": tail}, include_usage=include_usage)
        done = True
        if last.phase == wire.Phase.FAILED:
            yield sse_data(_failed(last).body())
        else:
            yield chat.chunk({}, FINISH_NAMES[wire.Finish(last.finish)] or "stop",
                             include_usage=include_usage)
            if include_usage:
                yield sse_data({**chat.head("chat.completion.chunk"), "choices": [],
                                "usage": usage(last)})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield sse_data(exc.body())
    finally:
        if not done:
            await calls.cancel_quietly(g, principal, rh)

