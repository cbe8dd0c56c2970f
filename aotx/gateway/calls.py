"""The device operations on requests, for every route that has one: submit (the message
envelope as a submission payload), read a window, wait for more, follow to the end,
cancel.

Streams wait with WAIT packets parked on the device, one mailbox each.  A principal's
calls hold at most its share of the mailboxes (``Gateway.call``), and its streams park
at most half of that; its streams beyond that poll with READs (holding no mailbox
between them) and answer as the WAIT would, so one principal's many open streams
cannot leave every mailbox taken.  A stream whose client leaves has the device answer
its parked WAIT at once (UNPARK).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from .. import ids, wire
from . import reasoning, tools
from .body import keep_alive_header
from .errors import ApiError, Call, refusal
from .render import dumps, native_token, state_fields
from .requests import ChatMessage, ChatRequest, ImageUrlPart, InputAudioPart, MediaPart, b64
from .service import Gateway, Once, Principal, parse_id
from .uploads import upload_inline

WAIT_MS = 10_000  # a parked WAIT answers at least this often (keep-alive cadence)
WAIT_POLL_S = 0.05
_CURSOR_RE = re.compile(r"[0-9]{1,20}")  # ASCII digits only (str.isdigit takes "²")
_ROLES = {"system": wire.Role.SYSTEM, "developer": wire.Role.SYSTEM, "user": wire.Role.USER,
          "assistant": wire.Role.ASSISTANT, "tool": wire.Role.TOOL}


def parse_cursor(value: str | None, param: str = "cursor", what: str = "byte offset") -> int:
    if value is None:
        return 0
    if not _CURSOR_RE.fullmatch(value) or int(value) >= 1 << 64:
        raise ApiError(400, f"{param} must be a decimal {what} below 2^64", param=param)
    return int(value)


# -- submit ---------------------------------------------------------------------------------
@dataclass
class Admitted:
    header: wire.Header  # the 202 reply
    model: wire.ModelInfo
    media: list[dict[str, str]]  # the media it leased: source id and digest, in order


def submission(body: ChatRequest, m: wire.ModelInfo, principal: Principal, allow_media: bool,
               inline: dict[int, wire.Part]) -> tuple[wire.Header, bytes, Call]:
    """The SUBMIT header and payload for ``body``, and what a refusal's wording needs."""
    messages = []
    digests: list[str] = []
    kinds: list[str] = []
    fmt = m.tool_format if body.uses_tools else wire.ToolFormat.FALLBACK
    for msg in body.envelope(fmt):
        parts = []
        for part in msg.parts():
            if isinstance(part, ImageUrlPart | InputAudioPart):
                if id(part) not in inline:
                    raise ApiError(400, "inline media was not uploaded", param="messages")
                parts.append(inline[id(part)])
            elif isinstance(part, MediaPart):
                if not allow_media:
                    raise ApiError(400, "media parts are accepted only on /aotx/v1/requests",
                                   param="messages")
                kind = (wire.PartKind.IMAGE_DIGEST if part.type == "input_image"
                        else wire.PartKind.AUDIO_DIGEST)
                parts.append(wire.Part(kind, part.digest_bytes))
            else:
                parts.append(wire.Part(wire.PartKind.TEXT, _utf8(part.text)))
            if parts[-1].kind is not wire.PartKind.TEXT:
                digests.append("sha256:" + parts[-1].data.hex())
                kinds.append(wire.PART_MODALITY[parts[-1].kind])
        if fmt is not wire.ToolFormat.FALLBACK:
            parts += _fields(msg)
        messages.append(wire.Message(_ROLES[msg.role], tuple(parts)))
    try:
        payload = wire.encode_submission(wire.Submission(
            tuple(messages), tuple(body.stops), body.sampling, body.constraint(fmt),
            _utf8(body.template_tools()) if fmt is not wire.ToolFormat.FALLBACK else b"",
            _utf8(json.dumps(args, ensure_ascii=False)) if (args := body.template_args())
            else b""))
    except wire.WireError as exc:
        # The codec's message is for a log; the client gets the table's wording of the
        # reason, as when the device refuses a packet.
        raise refusal(wire.Header().refuse(exc.status, exc.reason, exc.detail)) from None
    except UnicodeEncodeError:
        raise ApiError(400, "text is not valid UTF-8 (lone surrogate)", param="stop") from None
    limit = body.token_limit or 0
    if limit >= 1 << 32:
        raise ApiError(400, "max_tokens is too large", param="max_tokens")
    flags = seed = 0
    if body.seed is not None:
        flags |= wire.SUBMIT_FLAG_SEED
        seed = body.seed & ((1 << 64) - 1)
    if body.memory == "off":
        flags |= wire.SUBMIT_FLAG_MEMORY_OFF
    if body.tool_mode:
        flags |= wire.SUBMIT_FLAG_TOOLS
    flags |= fmt << wire.SUBMIT_TOOL_FORMAT_SHIFT
    keep, keep_fields = keep_alive_header(body.keep_alive)
    h = wire.Header.request(
        wire.Op.SUBMIT, principal=principal.id, role=m.role, max_tokens=limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, submit_flags=flags | keep, seed=seed,
        thought_budget=body.thought_budget, **keep_fields)
    field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    return h, payload, Call(m.alias, limit, len(payload), tuple(digests), tuple(kinds),
                            body.tool_names, field)


def _fields(msg: ChatMessage) -> list[wire.Part]:
    """A message's tool fields as a FIELDS part, for a template that renders tools."""
    if msg.tool_calls:
        value: dict[str, Any] = {"tool_calls": tools.template_calls(msg.tool_calls)}
    elif msg.role == "tool":
        value = {"tool_call_id": msg.tool_call_id}
    else:
        return []
    return [wire.Part(wire.PartKind.FIELDS, _utf8(json.dumps(value, ensure_ascii=False)))]


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON \\ud800 escape
        raise ApiError(400, "text is not valid Unicode (lone surrogate)",
                       param="messages") from None


def chat_model(g: Gateway, alias: str, principal: Principal) -> wire.ModelInfo:
    """The principal's model of that alias, which must generate text (404 otherwise,
    naming why: the device would refuse it as a model it does not have)."""
    m = g.model_for(alias, principal)
    if not m.context_tokens:
        kind, route = ("a reranker", "/v1/rerank") if m.rerank else ("an embedding model",
                                                                    "/v1/embeddings")
        raise ApiError(404, f"model {m.alias!r} is {kind}: it answers {route} only",
                       param="model", code="model_not_found")
    return m


async def prepare(g: Gateway, body: ChatRequest, principal: Principal, allow_media: bool
                  ) -> tuple[wire.ModelInfo, wire.Header, bytes, Call]:
    """``body``'s model, and its SUBMIT (its inline media uploaded first)."""
    await g.ensure_ready()  # the models are the device's: 503 if it was never reached
    m = chat_model(g, body.model, principal)
    inline = await upload_inline(g, body, m, principal)
    return m, *submission(body, m, principal, allow_media, inline)


async def submit(g: Gateway, body: ChatRequest, principal: Principal,
                 allow_media: bool = False) -> Admitted:
    m, h, payload, call = await prepare(g, body, principal, allow_media)
    # Media parts are prepared by the device's media worker: a longer deadline than text.
    rh, ids = await g.ask(h, payload, ok=(202,), context=call,
                          timeout=g.deadlines.of(h, media=bool(call.media)))
    sources = [f"src-{ids[i:i + 16].hex()}" for i in range(0, len(ids), 16)]
    if len(sources) != len(call.media):
        raise ApiError(502, "the device's admission named other media than the request")
    return Admitted(rh, m, [{"id": s, "digest": d} for s, d in zip(sources, call.media,
                                                                   strict=True)])


async def admission_body(g: Gateway, body: ChatRequest, principal: Principal) -> bytes:
    """POST /aotx/v1/requests: admit, and the admission document."""
    if body.stream:
        raise ApiError(400, "stream must be absent or false on /aotx/v1/requests; "
                            "follow GET /aotx/v1/requests/{id}/events instead", param="stream")
    if (body.n or 1) > 1:
        raise ApiError(400, "n must be 1 on /aotx/v1/requests: a request is one choice; "
                            "submit one per choice", param="n")
    a = await submit(g, body, principal, allow_media=True)
    return dumps({"schema": "aotx.admission.v1",
                  "id": ids.format_request_id(a.header.epoch, a.header.identity),
                  "runtime_epoch": str(a.header.epoch), "state": "accepted",
                  "persistence": "ephemeral", "media": a.media})


# -- read, wait, follow, cancel ---------------------------------------------------------------
async def read(g: Gateway, principal: Principal, epoch: int, identity: bytes, cursor: int,
               op: wire.Op = wire.Op.READ, seen: wire.Header | None = None,
               timeout_ms: int = WAIT_MS, flags: int = 0) -> tuple[wire.Header, bytes]:
    """The output window at ``cursor`` (with ``flags`` READ_FLAG_ANNOTATIONS: the
    annotation stream's), as READ, or as WAIT once there is something new."""
    pid = principal.id
    if op is wire.Op.WAIT and _over_wait_share(g, pid):
        # Over its share of parked WAITs: poll with READs and answer as the WAIT would,
        # on new bytes, a changed state, or the timeout; or park once its share has room.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while _over_wait_share(g, pid):
            await asyncio.sleep(WAIT_POLL_S)
            rh, body = await read(g, principal, epoch, identity, cursor, flags=flags)
            if (body or rh.total > cursor or seen is None
                    or (rh.phase, rh.cancel_requested) != (seen.phase, seen.cancel_requested)
                    or loop.time() >= deadline):
                return rh, body
        timeout_ms = max(1, int((deadline - loop.time()) * 1000))
    if op is not wire.Op.WAIT:
        h = wire.Header(op=op, principal=pid, epoch=epoch, identity=identity, cursor=cursor,
                        flags=flags)
        return await g.ask(h)
    h = wire.Header.request(wire.Op.WAIT, principal=pid, epoch=epoch, identity=identity,
                            cursor=cursor, wait_ms=timeout_ms, flags=flags,
                            phase=seen.phase if seen else 0,
                            cancel_requested=seen.cancel_requested if seen else 0)
    # The WAIT holds a mailbox until the device answers it, even when this call is
    # cancelled (the stream's client left): it is counted in ``parked`` until the broker
    # client reports it settled (its reply came, the connection dropped, or it was never
    # sent), and a cancelled caller has the device answer it at once (UNPARK) instead of
    # at its timeout.
    g.parked[pid] = g.parked.get(pid, 0) + 1
    held = Once(functools.partial(_not_parked, g, pid))
    try:
        rh, body = await g.call(h, settled=held)  # deadline: its wait_ms plus the margin
    except asyncio.CancelledError:
        if held.fns:  # (not settled: sent and unanswered, the device holds it)
            unpark = wire.Header(op=wire.Op.UNPARK, principal=pid, epoch=epoch,
                                 identity=identity)
            later = asyncio.ensure_future(g.call(unpark))
            g.background.add(later)
            later.add_done_callback(functools.partial(_unparked, g))
        raise
    if rh.status != 200:
        raise refusal(rh)
    return rh, body


def _not_parked(g: Gateway, pid: int) -> None:
    """The device no longer holds one of ``pid``'s WAITs."""
    g.parked[pid] -= 1
    if not g.parked[pid]:
        del g.parked[pid]


def _unparked(g: Gateway, task: asyncio.Future[Any]) -> None:
    """An UNPARK's reply came (or never will)."""
    g.background.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for its answer


def _over_wait_share(g: Gateway, pid: int) -> bool:
    """Parked WAITs take at most half of the principal's mailbox share: the other half
    stays for its submissions and reads."""
    return g.parked.get(pid, 0) >= max(1, g.mailbox_share() // 2)


async def follow(g: Gateway, principal: Principal, epoch: int, identity: bytes, cursor: int,
                 first: tuple[wire.Header, bytes] | None = None,
                 ) -> AsyncIterator[tuple[wire.Header, bytes, bool]]:
    """Yield (state, new bytes, changed) until the request is terminal and fully read.

    ``changed`` is True when the state fields differ from the previous yield.  A yield
    with no bytes and no change is a keep-alive tick.
    """
    seen: wire.Header | None = None
    rh, data = first if first is not None else await read(g, principal, epoch, identity, cursor)
    while True:
        changed = seen is None or (rh.phase, rh.cancel_requested, rh.finish) != (
            seen.phase, seen.cancel_requested, seen.finish)
        yield rh, data, changed
        cursor += len(data)
        seen = rh
        if wire.Phase(rh.phase).terminal and cursor >= rh.total:
            return
        op = wire.Op.READ if cursor < rh.total else wire.Op.WAIT
        rh, data = await read(g, principal, epoch, identity, cursor, op=op, seen=seen)


async def notes(g: Gateway, principal: Principal, epoch: int, identity: bytes, cursor: int
                ) -> tuple[list[dict[str, Any]], int]:
    """The annotation lines (engine/logprobs.py) published past ``cursor``, every one
    there is now (window after window), and the cursor after them."""
    out: list[dict[str, Any]] = []
    while True:
        rh, body = await read(g, principal, epoch, identity, cursor,
                              flags=wire.READ_FLAG_ANNOTATIONS)
        out += [orjson.loads(x) for x in body.splitlines()]
        cursor += len(body)
        if not body or cursor >= rh.total:
            return out, cursor


async def logprobs_body(g: Gateway, principal: Principal, rid: str, cursor: str | None) -> bytes:
    """The aotx.logprobs.v1 document for ``rid``: a window of its tokens' logprobs."""
    epoch, identity = parse_id(rid)
    pos = parse_cursor(cursor)
    try:
        rh, body = await read(g, principal, epoch, identity, pos,
                              flags=wire.READ_FLAG_ANNOTATIONS)
    except ApiError as exc:
        if exc.status != 409:
            raise
        raise ApiError(409, f"cursor {pos} does not start a token of the logprobs stream: "
                            "give 0 or a next_cursor", param="cursor") from None
    return dumps({"schema": "aotx.logprobs.v1", **state_fields(rh, g.by_role),
                  "logprobs": {"cursor": str(pos), "next_cursor": str(pos + len(body)),
                               "total_bytes": str(rh.total),
                               "content": [native_token(orjson.loads(x))
                                           for x in body.splitlines()]}})


async def message_body(g: Gateway, principal: Principal, rid: str, schema: str) -> bytes:
    """The parsed view of ``rid``'s output so far, as chat parses a finished one: a thinking
    model's thinking apart (gateway/reasoning.py), and the tool calls where it offered
    tools (gateway/tools.py).  ``schema``: aotx.message.v1, any request's; or
    aotx.tool_calls.v1, 409 for a request that offered no tools (its output is text)."""
    epoch, identity = parse_id(rid)
    out, cursor = bytearray(), 0
    while True:
        rh, data = await read(g, principal, epoch, identity, cursor)
        out += data
        cursor += len(data)
        if not data or cursor >= rh.total:
            break
    offered = bool(rh.submit_flags & wire.SUBMIT_FLAG_TOOLS)
    if schema == "aotx.tool_calls.v1" and not offered:
        raise ApiError(409, "the request offered no tools: its output is text, read it with "
                            "GET /aotx/v1/requests/{id}", code="no_tools")
    thought, text = reasoning.split(rh.submit_flags, out.decode("utf-8", errors="replace"))
    message, _ = tools.message(text, "stop", "auto" if offered else None, identity,
                               wire.submit_tool_format(rh.submit_flags))
    if thought is not None:
        message["reasoning_content"] = thought
    return dumps({"schema": schema, **state_fields(rh, g.by_role), "message": message})


async def window_body(g: Gateway, principal: Principal, rid: str, cursor: str | None) -> bytes:
    """The aotx.request.v1 document for ``rid`` with the window at ``cursor``."""
    epoch, identity = parse_id(rid)
    pos = parse_cursor(cursor)
    rh, data = await read(g, principal, epoch, identity, pos)
    return dumps({"schema": "aotx.request.v1", **state_fields(rh, g.by_role),
                  "output": {"encoding": "base64", "bytes": b64(data), "cursor": str(pos),
                             "next_cursor": str(pos + len(data)),
                             "total_bytes": str(rh.total)}})


async def cancel(g: Gateway, principal: Principal, epoch: int, identity: bytes,
                 admin: bool = False) -> wire.Header:
    """Cancel the caller's request; ``admin``: anybody's (the grant needs the admin action)."""
    h = wire.Header.request(wire.Op.CANCEL, principal=principal.id, epoch=epoch,
                            identity=identity,
                            cancel_flags=wire.CANCEL_FLAG_ADMIN if admin else 0)
    rh, _ = await g.ask(h, ok=(202,))
    return rh


async def cancel_quietly(g: Gateway, principal: Principal, rh: wire.Header) -> None:
    """Cancel on the device even while this task is being cancelled (client gone)."""
    task = asyncio.ensure_future(cancel(g, principal, rh.epoch, rh.identity))
    try:
        await asyncio.shield(task)
    except (ApiError, asyncio.CancelledError):
        pass
