"""The standard (OpenAI-compatible) routes: models and chat completions.

A standard request is a device request like any other; the gateway follows it to the
end and decodes its bytes as UTF-8 (incrementally, for streams).  A standard stream
whose client disconnects is cancelled on the device.

With ``logprobs``, the tokens' logprobs come from the request's annotation stream
(READ_FLAG_ANNOTATIONS): read whole at the end, or, in a stream, each chunk carries the
tokens whose bytes its text holds (aligned by their byte offsets in the output).
"""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from .. import ids, wire
from . import calls, choices, tools
from . import schemas as S
from .errors import ApiError, wording
from .render import FINISH_NAMES, json_response, openai_model, sse_data, token_logprob, usage
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
    if (body.n or 1) > 1:
        return await choices.completion(g, body, principal, _failed)
    a = await calls.submit(g, body, principal)
    rh = a.header
    rid = ids.format_request_id(rh.epoch, rh.identity)
    chat = Chat("chatcmpl-" + rid[4:], int(time.time()), a.model.alias, rh)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(g, principal, chat, include_usage,
                                              bool(body.logprobs), body.tool_mode),
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
    logprobs = None
    if body.logprobs:
        lines, _ = await calls.notes(g, principal, rh.epoch, rh.identity, 0)
        logprobs = {"content": [token_logprob(n) for n in lines], "refusal": None}
    message, finish = tools.message(text, FINISH_NAMES[wire.Finish(last.finish)] or "stop",
                                    body.tool_mode)
    return json_response({
        **chat.head("chat.completion"),
        "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                     "finish_reason": finish}],
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
              include_usage: bool = False, logprobs: list[dict[str, Any]] | None = None
              ) -> bytes:
        lp = None if logprobs is None else {"content": logprobs, "refusal": None}
        obj = {**self.head("chat.completion.chunk"),
               "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                            "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return sse_data(obj)


class _Text:
    """A stream's output bytes as its chunks' text: decoded incrementally; with logprobs
    (``notes``), cut only where a token ends on a character boundary, each piece with
    the logprobs of exactly its tokens (the device publishes a token's annotation line
    with its last byte, so read after the bytes, the lines cover them)."""

    def __init__(self, g: Gateway, principal: Principal, rh: wire.Header,
                 notes: bool, tool_mode: tools.Mode | None = None) -> None:
        self.g, self.principal, self.rh, self.notes = g, principal, rh, notes
        # without notes: decoded incrementally, tool calls held back (never both: the
        # request body refuses logprobs with tools)
        self.decoder = _ToolDecoder(tool_mode)
        self.held = bytearray()  # with notes: output bytes not sent yet, from ``start``
        self.start = 0
        self.cursor = 0  # in the annotation stream
        self.pending: list[dict[str, Any]] = []  # lines read, not sent yet

    async def add(self, data: bytes, final: bool = False) -> list[tuple[str, Any]]:
        """(text, logprobs or None) for the chunks ``data`` completes (``final``: the
        output is complete, everything goes)."""
        if not self.notes:
            text = self.decoder.decode(data, final=final)
            return [(text, None)] if text else []
        self.held += data
        end = self.start + len(self.held)
        if data or final:
            more, self.cursor = await calls.notes(self.g, self.principal, self.rh.epoch,
                                                  self.rh.identity, self.cursor)
            self.pending += more
        take, cut = 0, self.start
        for i, n in enumerate(self.pending):
            e = int(n["offset"]) + len(n["bytes"])
            if e > end:
                break
            if _boundary(self.held, e - self.start):
                take, cut = i + 1, e
        if final:
            take, cut = len(self.pending), end
        if not take and cut == self.start:
            return []
        text = bytes(self.held[:cut - self.start]).decode("utf-8", errors="replace")
        del self.held[:cut - self.start]
        sent, self.pending, self.start = self.pending[:take], self.pending[take:], cut
        return [(text, [token_logprob(n) for n in sent])]


def _boundary(data: bytearray, p: int) -> bool:
    """Is ``p`` a character boundary in UTF-8 ``data`` (its end: unless a character runs
    past it)?"""
    if p < len(data):
        return data[p] & 0xC0 != 0x80
    for back in range(1, min(4, p) + 1):
        b = data[p - back]
        if b & 0xC0 != 0x80:
            return back >= (1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4)
    return True


async def _chat_stream(g: Gateway, principal: Principal, chat: Chat, include_usage: bool,
                       logprobs: bool = False, tool_mode: tools.Mode | None = None
                       ) -> AsyncIterator[bytes]:
    rh = chat.admitted
    text = _Text(g, principal, rh, logprobs, tool_mode)
    done = False
    try:
        yield chat.chunk({"role": "assistant", "content": ""}, include_usage=include_usage)
        last = rh
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            for piece, lps in await text.add(data):
                yield chat.chunk({"content": piece}, include_usage=include_usage, logprobs=lps)
        for piece, lps in await text.add(b"", final=True):
            yield chat.chunk({"content": piece}, include_usage=include_usage, logprobs=lps)
        done = True
        if last.phase == wire.Phase.FAILED:
            yield sse_data(_failed(last).body())
        else:
            finish = FINISH_NAMES[wire.Finish(last.finish)] or "stop"
            for delta in text.decoder.end():
                yield chat.chunk(delta, include_usage=include_usage)
            yield chat.chunk({}, text.decoder.finish(finish), include_usage=include_usage)
            if include_usage:
                yield sse_data({**chat.head("chat.completion.chunk"), "choices": [],
                                "usage": usage(last)})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield sse_data(exc.body())
    finally:
        if not done:
            await calls.cancel_quietly(g, principal, rh)


class _ToolDecoder:
    """The stream's UTF-8 decoder; with tools offered, calls are held back until the
    output ends and then streamed as ``delta.tool_calls`` (gateway/tools.py)."""

    def __init__(self, mode: tools.Mode | None) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tools = tools.ToolStream(mode) if mode else None
        self._calls = False

    def decode(self, data: bytes, final: bool = False) -> str:
        text = self._utf8.decode(data, final)
        return self._tools.feed(text) if self._tools else text

    def end(self) -> list[dict[str, Any]]:
        """The deltas held back: content, then the calls'."""
        if self._tools is None:
            return []
        content, deltas, _ = self._tools.end("stop")
        self._calls = bool(deltas)
        return [{"content": content}] * bool(content) + deltas

    def finish(self, finish: str) -> str:
        return "tool_calls" if self._calls and finish == "stop" else finish
