"""``POST /v1/completions``: OpenAI's legacy text completion on raw prompts.

Each prompt, ``n`` times, is one device request (a raw submission: gateway/completions.py),
admitted in order: choice ``prompt_index * n + i``, seed + i when a seed is given, as
chat completions' ``n`` (gateway/choices.py).  The gateway follows them together: the
answer lists every choice, or a stream interleaves ``text_completion`` chunks, each with
its ``index``.  Usage counts each prompt once and every choice's tokens.  A stream whose
client leaves, or an admission refused part way, cancels every request admitted.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from .. import ids, wire
from . import calls
from . import schemas as S
from .completions import CompletionRequest, Cutter, Prompt, submission
from .errors import ApiError
from .render import finish_reason, json_response, sse_data
from .service import Caller, Gateway, Principal, Service

log = logging.getLogger("aotx.gateway")
router = APIRouter(tags=["standard"], redirect_slashes=False)


@dataclass
class Choice:
    index: int
    prompt: Prompt
    admitted: wire.Header  # the 202 reply


@router.post("/v1/completions", response_model=S.Completion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "the completion, or with stream: true an SSE "
                                             "stream of text_completion objects"}})
async def completions(body: CompletionRequest, principal: Principal = Caller,
                      g: Gateway = Service) -> Response:
    body.check()
    await g.ensure_ready()  # the models are the device's: 503 if it was never reached
    m = calls.chat_model(g, body.model, principal)
    choices = await _admit(g, body, m, principal)
    first = choices[0].admitted
    rid = ids.format_request_id(first.epoch, first.identity)
    if body.user is not None:  # OpenAI's end-user tag: the operator's log keeps it
        log.debug("event=completion.user id=%s choices=%d user=%r", rid, len(choices),
                  body.user)
    head = {"id": "cmpl-" + rid[4:], "object": "text_completion", "created": int(time.time()),
            "model": m.alias, "system_fingerprint": f"aotx-{first.epoch}"}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(g, principal, body, choices, head, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Request-Id": rid})
    done = False
    try:
        got = await asyncio.gather(*(_whole(g, principal, c, body.logprobs) for c in choices))
        done = True
    finally:
        if not done:
            await _cancel(g, principal, choices)
    for last, _ in got:
        if last.phase == wire.Phase.FAILED:
            raise await g.failure(last)
    return json_response({**head, "choices": [
        {"index": c.index, "text": _echo(body, c) + text, "logprobs": lp,
         "finish_reason": finish_reason(last)} for c, (last, (text, lp)) in zip(choices, got,
                                                                          strict=True)],
        "usage": _usage(body, [last for last, _ in got])}, headers={"X-Request-Id": rid})


async def _admit(g: Gateway, body: CompletionRequest, m: wire.ModelInfo,
                 principal: Principal) -> list[Choice]:
    """Admit every prompt's n choices, in order; a refusal cancels those admitted."""
    n, prompts = body.n or 1, body.prompts
    out: list[Choice] = []
    try:
        for p, prompt in enumerate(prompts):
            for i in range(n):
                h, payload, call = submission(body, prompt, i, m, principal)
                try:
                    rh, _ = await g.ask(h, payload, ok=(202,), context=call)
                except ApiError as exc:
                    if exc.param == "messages":  # the chat wording's field is this prompt
                        exc.param = "prompt"
                        if len(prompts) > 1:
                            exc.message = f"prompt {p}: {exc.message}"
                    raise
                out.append(Choice(p * n + i, prompt, rh))
    except BaseException:
        await _cancel(g, principal, out)
        raise
    return out


def _echo(body: CompletionRequest, c: Choice) -> str:
    return c.prompt if body.echo and isinstance(c.prompt, str) else ""


def _usage(body: CompletionRequest, lasts: list[wire.Header]) -> dict[str, int]:
    """Each prompt once (its n choices share it), every choice's sampled tokens."""
    n = body.n or 1
    prompt_tokens = sum(h.prompt_tokens for h in lasts[::n])
    completion_tokens = sum(h.sampled_tokens for h in lasts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _cancel(g: Gateway, principal: Principal, choices: list[Choice]) -> None:
    for c in choices:
        await calls.cancel_quietly(g, principal, c.admitted)


async def _whole(g: Gateway, principal: Principal, c: Choice, logprobs: int | None
                 ) -> tuple[wire.Header, tuple[str, dict[str, list[Any]] | None]]:
    """A choice followed to its end: its final state, text and legacy logprobs."""
    rh, out = c.admitted, []
    last = rh
    async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
        out.append(data)
    if logprobs is None:
        return last, (b"".join(out).decode("utf-8", errors="replace"), None)
    notes, _ = await calls.notes(g, principal, rh.epoch, rh.identity, 0)
    piece = Cutter(logprobs).add(b"".join(out), notes, final=True)
    return last, piece or ("", {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []})


# One choice's events for the stream: (index, text, logprobs, None) for a piece;
# (index, None, None, final state) at its end; (index, None, None, ApiError) when it
# became unreadable.
Event = tuple[int, str | None, dict[str, list[Any]] | None, wire.Header | ApiError | None]


async def _stream(g: Gateway, principal: Principal, body: CompletionRequest,
                  choices: list[Choice], head: dict[str, Any], include_usage: bool
                  ) -> AsyncIterator[bytes]:
    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> bytes:
        obj = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": finish}]}
        return sse_data({**obj, "usage": None} if include_usage else obj)

    queue: asyncio.Queue[Event] = asyncio.Queue()
    followers = [asyncio.ensure_future(_feed(g, principal, c, body.logprobs, queue))
                 for c in choices]
    lasts = [c.admitted for c in choices]
    try:
        for c in choices:
            if _echo(body, c):
                yield chunk(c.index, _echo(body, c))
        open_choices = len(choices)
        while open_choices:
            index, text, lp, end = await queue.get()
            if text is not None:
                yield chunk(index, text, lp)
                continue
            if isinstance(end, ApiError):
                raise end
            assert end is not None
            open_choices -= 1
            lasts[index] = end
            if end.phase == wire.Phase.FAILED:  # the others are cancelled below
                yield sse_data((await g.failure(end)).body())
                yield b"data: [DONE]\n\n"
                return
            yield chunk(index, "", None, finish_reason(end))
        if include_usage:
            yield sse_data({**head, "choices": [], "usage": _usage(body, lasts)})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield sse_data(exc.body())
    finally:
        for f in followers:
            f.cancel()
        # a client gone, a failed or unreadable choice: the choices still running end too
        await _cancel(g, principal, [c for c, h in zip(choices, lasts, strict=True)
                                     if not wire.Phase(h.phase).terminal])


async def _feed(g: Gateway, principal: Principal, c: Choice, logprobs: int | None,
                queue: asyncio.Queue[Event]) -> None:
    """One choice's pieces into ``queue``, then its final state (or the error)."""
    rh = c.admitted
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    cutter = None if logprobs is None else Cutter(logprobs)
    cursor = 0  # in the annotation stream
    last = rh
    try:
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            if cutter is None:
                text = decoder.decode(data)
                if text:
                    await queue.put((c.index, text, None, None))
                continue
            if not data:
                continue
            # Read after the bytes, the annotation lines cover every token they hold.
            notes, cursor = await calls.notes(g, principal, rh.epoch, rh.identity, cursor)
            piece = cutter.add(data, notes)
            if piece is not None:
                await queue.put((c.index, piece[0], piece[1], None))
        if cutter is None:
            tail = decoder.decode(b"", final=True)
            if tail:
                await queue.put((c.index, tail, None, None))
        else:
            notes, cursor = await calls.notes(g, principal, rh.epoch, rh.identity, cursor)
            piece = cutter.add(b"", notes, final=True)
            if piece is not None:
                await queue.put((c.index, piece[0], piece[1], None))
    except ApiError as exc:
        await queue.put((c.index, None, None, exc))
        return
    await queue.put((c.index, None, None, last))
