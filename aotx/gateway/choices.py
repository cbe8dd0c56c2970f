"""A chat completion's choices: one device request per choice, followed together.

``n`` > 1 admits n requests with the same messages (the seed, when given, is seed,
seed + 1, ...: each choice samples apart, and a seed reproduces them all).  They reach
the device together, so its scheduler evaluates their common prompt once: the later
ones wait for the first and copy its cells (``Scheduler._twin_preparing``).  Usage
counts the prompt once and every choice's tokens.

Each choice's bytes become chat deltas in a :class:`ChoiceText`: decoded as UTF-8;
with ``logprobs``, cut only where a token ends on a character boundary so that each
chunk carries the logprobs of exactly its tokens (the device publishes a token's
annotation line with its last byte, so read after the bytes, the lines cover them);
with tools, calls held back until the output ends (gateway/tools.py).  A stream
interleaves the choices' chunks, each with its ``index``; a client that leaves cancels
every choice.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import Response, StreamingResponse

from .. import ids, seeds, wire
from . import calls, reasoning, tools
from .errors import ApiError
from .render import finish_reason, json_response, sse_data, token_logprob
from .requests import ChatRequest
from .service import Gateway, Principal

log = logging.getLogger("aotx.gateway")

# A stream chunk of one choice: its delta, the logprobs of the tokens the delta's text
# holds (with ``logprobs``) and the finish_reason (the last chunk).
Event = tuple[dict[str, Any], list[dict[str, Any]] | None, str | None]
#: The event of a keep-alive tick while the request is preparing (its model loads).
WAITING: Event = ({}, None, None)


async def completion(g: Gateway, body: ChatRequest, principal: Principal) -> Response:
    """POST /v1/chat/completions: admit the choices, then answer whole or as a stream."""
    admitted = await _admit(g, body, principal)
    first = admitted[0].header
    rid = ids.format_request_id(first.epoch, first.identity)
    head = {"id": "chatcmpl-" + rid[4:], "created": int(time.time()),
            "model": admitted[0].model.alias, "system_fingerprint": f"aotx-{first.epoch}"}
    texts = [ChoiceText(g, principal, a.header, bool(body.logprobs), body.tool_mode)
             for a in admitted]
    headers = {"X-Request-Id": rid}
    if body.user is not None or body.safety_identifier is not None:
        # OpenAI's end-user tags: for the operator tracing abuse to an end user
        log.debug("event=chat.user id=%s choices=%d user=%r safety_identifier=%r", rid,
                  len(admitted), body.user, body.safety_identifier)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(texts, head, include_usage),
                                 media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-store"})
    done = False
    try:
        got = await asyncio.gather(*(t.whole() for t in texts))
        done = True
    finally:
        if not done:
            await _cancel(texts)
    for t in texts:
        if t.last.phase == wire.Phase.FAILED:
            raise await t.g.failure(t.last)
    return json_response({**head, "object": "chat.completion",
                          "choices": [{"index": i, **c} for i, c in enumerate(got)],
                          "usage": _usage([t.last for t in texts])}, headers=headers)


async def _admit(g: Gateway, body: ChatRequest, principal: Principal
                 ) -> list[calls.Admitted]:
    n = body.n or 1
    if n == 1:
        return [await calls.submit(g, body, principal)]
    admitted: list[calls.Admitted] = []
    try:
        for i in range(n):
            seed = None if body.seed is None else seeds.of_choice(body.seed, i)
            admitted.append(await calls.submit(g, body.model_copy(update={"seed": seed}),
                                               principal))
    except BaseException:
        for a in admitted:
            await calls.cancel_quietly(g, principal, a.header)
        raise
    return admitted


def _usage(lasts: list[wire.Header]) -> dict[str, Any]:
    """The prompt once (it was evaluated once), the tokens of every choice; a thinking
    model's, those it spent thinking too."""
    completion_tokens = sum(h.sampled_tokens for h in lasts)
    out: dict[str, Any] = {"prompt_tokens": lasts[0].prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": lasts[0].prompt_tokens + completion_tokens}
    if any(h.submit_flags & wire.STATE_FLAG_THINKS for h in lasts):
        out["completion_tokens_details"] = {
            "reasoning_tokens": sum(h.reasoning_tokens for h in lasts)}
    return out


async def _cancel(texts: list[ChoiceText]) -> None:
    for t in texts:
        await calls.cancel_quietly(t.g, t.principal, t.rh)


class ChoiceText:
    """One choice: its request's bytes as chat deltas, or its whole message."""

    def __init__(self, g: Gateway, principal: Principal, rh: wire.Header, notes: bool,
                 tool_mode: tools.Mode | None) -> None:
        self.g, self.principal, self.rh, self.notes = g, principal, rh, notes
        self.last = rh  # the request's latest state
        self._tick = False  # the last answer was a keep-alive tick
        self.mode = tool_mode
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.fmt = wire.submit_tool_format(rh.submit_flags)
        self._tools = tools.ToolStream(tool_mode, rh.identity, self.fmt) if tool_mode else None
        # with notes: output bytes not sent yet (from ``start``), the annotation cursor
        # and the lines read but not sent yet
        self._held = bytearray()
        self._start = 0
        self._cursor = 0
        self._pending: list[dict[str, Any]] = []
        # with tools: logprobs of text the tool stream holds, with the count of characters
        # fed when each piece ends
        self._fed = 0
        self._lps: list[tuple[int, list[dict[str, Any]]]] = []
        # a thinking model's: its thinking told from its answer (decided at the first
        # output, once the state says how the model thinks), and the logprobs of text
        # that splitter holds
        self._think: reasoning.ThinkStream | None = None
        self._decided = False
        self._think_lps: list[dict[str, Any]] = []

    async def whole(self) -> dict[str, Any]:
        """The choice's ``message``, ``logprobs`` and ``finish_reason`` (to its end)."""
        chunks = [data async for data in self._output()]
        logprobs = None
        if self.notes:
            lines, _ = await calls.notes(self.g, self.principal, self.rh.epoch,
                                         self.rh.identity, 0)
            logprobs = {"content": [token_logprob(n) for n in lines], "refusal": None}
        text = b"".join(chunks).decode("utf-8", errors="replace")
        thought, text = reasoning.split(self.last.submit_flags, text)
        message, finish = tools.message(text, finish_reason(self.last), self.mode,
                                        self.rh.identity, self.fmt)
        if thought is not None:
            message["reasoning_content"] = thought
        return {"message": message, "logprobs": logprobs, "finish_reason": finish}

    async def events(self) -> AsyncIterator[Event]:
        """The choice's deltas to its end (then ``last`` is its final state); a failed
        request ends them without a finish_reason.  Each keep-alive tick while the request
        is ``preparing`` (its model loading, or a long prompt) is :data:`WAITING`."""
        async for data in self._output():
            if self._tick and self.last.phase == wire.Phase.PREPARING:
                yield WAITING
                continue
            for delta in await self.add(data):
                yield delta
        for delta in await self.add(b"", final=True):
            yield delta
        if self.last.phase != wire.Phase.FAILED:
            for delta in self.end():
                yield delta

    async def _output(self) -> AsyncIterator[bytes]:
        """The request's output as it comes; ``last`` follows its state."""
        async for last, data, changed in calls.follow(self.g, self.principal, self.rh.epoch,
                                                      self.rh.identity, 0):
            self.last = last
            self._tick = not data and not changed  # a keep-alive answer: nothing new
            yield data

    async def add(self, data: bytes, final: bool = False) -> list[Event]:
        """The content deltas that ``data`` completes (``final``: the output is whole)."""
        out: list[Event] = []
        for kind, text, lps in self._thought(await self._pieces(data, final), final):
            if kind == "thinking":
                out.append(({"reasoning_content": text}, lps, None))
                continue
            if self._tools is None:
                out.append(({"content": text}, lps, None))
                continue
            self._fed += len(text)
            if lps is not None:
                self._lps.append((self._fed, lps))
            sent = self._tools.feed(text)
            if sent:
                lps_ = self._release(self._fed - len(self._tools.held))
                out.append(({"content": sent}, lps_, None))
        return out

    def _thought(self, pieces: list[tuple[str, Any]], final: bool
                 ) -> list[tuple[str, str, Any]]:
        """The pieces as ("thinking" | "answer", text, logprobs): a thinking model's
        split as they come (its held text's logprobs go with the next piece out)."""
        if not self._decided and (pieces or final):
            self._decided = True
            self._think = reasoning.stream(self.last.submit_flags)
        if self._think is None:
            return [("answer", text, lps) for text, lps in pieces]
        got: list[tuple[str, str]] = []
        for text, lps in pieces:
            self._think_lps += lps or []
            got += self._think.feed(text)
        got += self._think.end() if final else []
        if final and self._think_lps and not got:
            got = [("answer", "")]
        out = []
        for kind, text in got:
            lps, self._think_lps = (self._think_lps if self.notes else None), []
            out.append((kind, text, lps))
        return out

    def end(self) -> list[Event]:
        """The deltas held back (content, then the calls') and the last, with the
        finish_reason.  Held logprobs go with the first of them."""
        finish = finish_reason(self.last)
        deltas: list[dict[str, Any]] = []
        if self._tools is not None:
            content, calls_, finish = self._tools.end(finish)
            deltas = [{"content": content}] * bool(content) + calls_
        lps = self._release(None)
        out: list[Event] = [(d, lps if i == 0 else None, None) for i, d in enumerate(deltas)]
        if lps and not out:
            out.append(({"content": ""}, lps, None))
        return [*out, ({}, None, finish)]

    def _release(self, upto: int | None) -> list[dict[str, Any]] | None:
        """The held logprobs of pieces that end by character ``upto`` (None: all)."""
        if not self.notes:
            return None
        take = [lps for end, lps in self._lps if upto is None or end <= upto]
        self._lps = self._lps[len(take):]
        return [x for lps in take for x in lps]

    async def _pieces(self, data: bytes, final: bool) -> list[tuple[str, Any]]:
        """(text, logprobs or None) for the pieces ``data`` completes."""
        if not self.notes:
            text = self._utf8.decode(data, final)
            return [(text, None)] if text else []
        self._held += data
        end = self._start + len(self._held)
        if data or final:
            more, self._cursor = await calls.notes(self.g, self.principal, self.rh.epoch,
                                                   self.rh.identity, self._cursor)
            self._pending += more
        take, cut = 0, self._start
        for i, n in enumerate(self._pending):
            e = int(n["offset"]) + len(n["bytes"])
            if e > end:
                break
            if _boundary(self._held, e - self._start):
                take, cut = i + 1, e
        if final:
            take, cut = len(self._pending), end
        if not take and cut == self._start:
            return []
        text = bytes(self._held[:cut - self._start]).decode("utf-8", errors="replace")
        del self._held[:cut - self._start]
        sent, self._pending, self._start = self._pending[:take], self._pending[take:], cut
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


async def _stream(texts: list[ChoiceText], head: dict[str, Any], include_usage: bool
                  ) -> AsyncIterator[bytes]:
    """The chunks of every choice as they come, then the usage chunk (asked) and [DONE];
    a choice that fails ends the stream with its error and cancels the others."""
    def chunk(index: int, delta: dict[str, Any], lps: list[dict[str, Any]] | None,
              finish: str | None) -> bytes:
        obj = {**head, "object": "chat.completion.chunk",
               "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                            "logprobs": None if lps is None else {"content": lps,
                                                                   "refusal": None}}]}
        return sse_data({**obj, "usage": None} if include_usage else obj)

    done = False
    try:
        for i in range(len(texts)):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        async with aclosing(_merge(texts)) as events:
            async for i, event in events:
                if event is WAITING:  # an SSE comment: proxies see the stream is alive
                    yield b": preparing\n\n"
                elif event is not None:
                    yield chunk(i, *event)
                elif texts[i].last.phase == wire.Phase.FAILED:
                    raise await texts[i].g.failure(texts[i].last)
        done = True
        if include_usage:
            yield sse_data({**head, "object": "chat.completion.chunk", "choices": [],
                            "usage": _usage([t.last for t in texts])})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield sse_data(exc.body())
    finally:
        if not done:
            await _cancel(texts)


async def _merge(texts: list[ChoiceText]) -> AsyncGenerator[tuple[int, Event | None]]:
    """(choice index, event) as each choice's events come; (index, None) when a choice
    ends.  One choice is followed in place; several each in a task of their own."""
    if len(texts) == 1:
        async for event in texts[0].events():
            yield 0, event
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Event | None | ApiError]] = asyncio.Queue()

    async def feed(i: int, t: ChoiceText) -> None:
        try:
            async for event in t.events():
                await queue.put((i, event))
            await queue.put((i, None))
        except ApiError as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(feed(i, t)) for i, t in enumerate(texts)]
    try:
        open_choices = len(texts)
        while open_choices:
            i, got = await queue.get()
            if isinstance(got, ApiError):
                raise got
            open_choices -= got is None
            yield i, got
    finally:
        for task in tasks:
            task.cancel()
