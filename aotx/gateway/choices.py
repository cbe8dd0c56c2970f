"""``n`` choices of one chat completion: n device requests, followed together.

The gateway admits n requests with the same messages (the seed, when given, is seed,
seed + 1, ...: each choice samples apart, and a seed reproduces them all).  They reach
the device together, so its scheduler evaluates their common prompt once: the later
ones wait for the first and copy its cells (``Scheduler._twin_preparing``).  Usage
counts the prompt once and every choice's tokens.  A stream interleaves the choices'
chunks, each carrying its ``index``; a client that leaves cancels every choice.
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from .. import ids, wire
from . import calls
from .errors import ApiError
from .render import FINISH_NAMES, json_response, sse_data
from .requests import ChatRequest
from .service import Gateway, Principal

Choice = tuple[wire.Header, bytes]  # the final state and the output of one choice


async def completion(g: Gateway, body: ChatRequest, principal: Principal,
                     failed: Any) -> Response:
    """POST /v1/chat/completions with ``n`` > 1 (``failed``: how a failed request answers)."""
    n = body.n or 1
    admitted: list[calls.Admitted] = []
    try:
        for i in range(n):
            seed = None if body.seed is None else (body.seed + i) & ((1 << 64) - 1)
            admitted.append(await calls.submit(g, body.model_copy(update={"seed": seed}),
                                               principal))
    except BaseException:
        await _cancel(g, principal, admitted)
        raise
    first = admitted[0].header
    rid = ids.format_request_id(first.epoch, first.identity)
    head = {"id": "chatcmpl-" + rid[4:], "created": int(time.time()),
            "model": admitted[0].model.alias, "system_fingerprint": f"aotx-{first.epoch}"}
    headers = {"X-Request-Id": rid}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(g, principal, admitted, head, include_usage),
                                 media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-store"})
    done = False
    try:
        got = await asyncio.gather(*(_whole(g, principal, a.header) for a in admitted))
        done = True
    finally:
        if not done:
            await _cancel(g, principal, admitted)
    for last, _ in got:
        if last.phase == wire.Phase.FAILED:
            raise failed(last)
    return json_response({
        **head, "object": "chat.completion",
        "choices": [{"index": i, "message": {"role": "assistant",
                                             "content": out.decode("utf-8", "replace")},
                     "logprobs": None, "finish_reason": _finish(last)}
                    for i, (last, out) in enumerate(got)],
        "usage": _usage([last for last, _ in got]),
    }, headers=headers)


async def _whole(g: Gateway, principal: Principal, rh: wire.Header) -> Choice:
    out, last = [], rh
    async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
        out.append(data)
    return last, b"".join(out)


def _finish(h: wire.Header) -> str:
    return FINISH_NAMES[wire.Finish(h.finish)] or "stop"


def _usage(lasts: list[wire.Header]) -> dict[str, int]:
    """The prompt once (it was evaluated once), the tokens of every choice."""
    completion_tokens = sum(h.sampled_tokens for h in lasts)
    return {"prompt_tokens": lasts[0].prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": lasts[0].prompt_tokens + completion_tokens}


async def _cancel(g: Gateway, principal: Principal, admitted: list[calls.Admitted]) -> None:
    for a in admitted:
        await calls.cancel_quietly(g, principal, a.header)


async def _stream(g: Gateway, principal: Principal, admitted: list[calls.Admitted],
                  head: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {**head, "object": "chat.completion.chunk",
               "choices": [{"index": index, "delta": delta, "logprobs": None,
                            "finish_reason": finish}]}
        return sse_data({**obj, "usage": None} if include_usage else obj)

    queue: asyncio.Queue[tuple[int, dict[str, Any] | None, wire.Header]] = asyncio.Queue()
    followers = [asyncio.ensure_future(_feed(g, principal, a.header, i, queue))
                 for i, a in enumerate(admitted)]
    lasts: list[wire.Header] = [a.header for a in admitted]
    done = False
    try:
        for i in range(len(admitted)):
            yield chunk(i, {"role": "assistant", "content": ""})
        open_choices = len(admitted)
        while open_choices:
            i, delta, last = await queue.get()
            if delta is not None:
                yield chunk(i, delta)
                continue
            open_choices -= 1
            lasts[i] = last
            if last.phase == wire.Phase.FAILED:
                raise ApiError(last.failure or 500, "a choice failed on the device")
            yield chunk(i, {}, _finish(last))
        done = True
        if include_usage:
            yield sse_data({**head, "object": "chat.completion.chunk", "choices": [],
                            "usage": _usage(lasts)})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield sse_data(exc.body())
    finally:
        for f in followers:
            f.cancel()
        if not done:
            await _cancel(g, principal, admitted)


async def _feed(g: Gateway, principal: Principal, rh: wire.Header, index: int,
                queue: asyncio.Queue[tuple[int, dict[str, Any] | None, wire.Header]]) -> None:
    """One choice's text deltas into ``queue``, then (index, None, its final state)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    last = rh
    try:
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            text = decoder.decode(data)
            if text:
                await queue.put((index, {"content": text}, last))
        tail = decoder.decode(b"", final=True)
        if tail:
            await queue.put((index, {"content": tail}, last))
    except ApiError:
        last = last._replace(phase=int(wire.Phase.FAILED), failure=503)
    await queue.put((index, None, last))
