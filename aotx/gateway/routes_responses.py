"""``/v1/responses``: OpenAI's Responses API on device requests (gateway/responses.py).

``POST /v1/responses`` admits one device request and answers its response object: at
once with ``background`` (status ``queued`` or ``in_progress``), after its end without,
or as a stream of events (gateway/response_events.py).  Every other route reads the
device first, so ownership, grant revisions and epochs are the device's rules (404,
410), then what the gateway stored of the response (gateway/response_store.py).

A stream of a ``background`` response outlives its connection: the client reconnects
with ``GET /v1/responses/{id}?stream=true&starting_after=N`` and gets the events after
N, computed again from the device's bytes.  A stream of a response that is not in the
background cancels it when its client leaves, as chat streams do.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from .. import ids, wire
from . import calls, routes_tokens
from . import schemas as S
from .errors import ApiError
from .render import dumps, json_response, sse, sse_data
from .response_events import Events, Snapshot
from .response_store import SWEEP_ROWS, ResponseStore, Stored
from .responses import (
    ResponseRequest,
    input_item_ids,
    output_items,
    parse_response_id,
    response_id,
    response_object,
    reworded,
)
from .service import Caller, Gateway, Principal, Service

log = logging.getLogger("aotx.gateway")
router = APIRouter(tags=["standard"], redirect_slashes=False)
CANCEL_WAIT_S = 5.0  # a cancel answers once the request stopped, or after this long
SWEEP_S = 60.0
_SSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}},
              "description": "the response, or with stream: true an SSE stream of "
                             "response events"}}


def store(request: Request) -> ResponseStore:
    st: ResponseStore = request.app.state.responses
    return st


Store = Depends(store)


# -- reading the device -----------------------------------------------------------------------
def _own(st: ResponseStore, principal: Principal, rid: str,
         param: str | None = None) -> tuple[int, bytes]:
    """(epoch, identity) of ``rid``; 404 for a malformed id or a deleted response."""
    epoch, identity = parse_response_id(rid, param)
    if st.deleted(principal.id, epoch, identity):
        raise ApiError(404, f"no response with id {rid!r}", param=param)
    return epoch, identity


def _named(exc: ApiError, rid: str, param: str | None = None) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no response with id {rid!r}", param=param)
    if exc.status == 410:
        exc.param = param
    return exc


async def _read(g: Gateway, principal: Principal, rid: str, epoch: int, identity: bytes,
                param: str | None = None) -> tuple[wire.Header, bytes]:
    """The request's state and every output byte there is now."""
    out, cursor = bytearray(), 0
    try:
        while True:
            rh, data = await calls.read(g, principal, epoch, identity, cursor)
            out += data
            cursor += len(data)
            if not data or cursor >= rh.total:
                return rh, bytes(out)
    except ApiError as exc:
        raise _named(exc, rid, param) from None


async def _to_end(g: Gateway, principal: Principal, rh: wire.Header
                  ) -> tuple[wire.Header, bytes]:
    out = bytearray()
    last = rh
    async for state, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):
        out += data
        last = state
    return last, bytes(out)


def _stored(st: ResponseStore, principal: Principal, epoch: int, identity: bytes) -> Stored:
    """What the store has of a response whose READ the device just answered.  A request
    it has no row for (a chat completion's, read as a response) gets its creation time
    now, so that every later read says the same ``created_at``."""
    got = st.get(principal.id, epoch, identity)
    return got if got is not None else st.seen(principal.id, epoch, identity, time.time())


def _object(g: Gateway, rh: wire.Header, data: bytes, stored: Stored) -> dict[str, Any]:
    m = g.by_role.get(rh.role)
    return response_object(rh, data, m.alias if m else None, stored.echo, stored.created_at)


def _snapshot(g: Gateway, rh: wire.Header, stored: Stored) -> Snapshot:
    m = g.by_role.get(rh.role)
    return functools.partial(_snap, m.alias if m else None, stored.echo, stored.created_at)


def _snap(alias: str | None, echo: dict[str, Any] | None, created_at: float, h: wire.Header,
          data: bytes, snapshot: str | None) -> dict[str, Any]:
    return response_object(h, data, alias, echo, created_at, snapshot)


# -- POST /v1/responses -----------------------------------------------------------------------
@router.post("/v1/responses", response_model=S.ResponseObject, responses=_SSE)
async def create_response(body: ResponseRequest, request: Request,
                          principal: Principal = Caller, g: Gateway = Service,
                          st: ResponseStore = Store) -> Response:
    context = (await _context(g, st, principal, body.previous_response_id)
               if body.previous_response_id else [])
    try:
        admitted = await calls.submit(g, body.chat(context), principal, allow_media=True)
    except ApiError as exc:
        raise reworded(exc) from None
    rh = admitted.header
    # Shown as a later retrieve shows it: a response not stored has the defaults, and
    # keeps only its creation time (the same created_at on every read).
    if body.stored:
        stored = st.put(principal.id, rh.epoch, rh.identity, time.time(), body.echo(),
                        body.items(), context)
    else:
        stored = st.seen(principal.id, rh.epoch, rh.identity, time.time())
    _maybe_sweep(g, st)
    headers = {"X-Request-Id": ids.format_request_id(rh.epoch, rh.identity)}
    if body.user is not None or body.safety_identifier is not None:
        # OpenAI's end-user tags: for the operator tracing abuse, in the log only
        log.debug("event=response.user id=%s user=%r safety_identifier=%r",
                  headers["X-Request-Id"], body.user, body.safety_identifier)
    if body.stream:
        return StreamingResponse(
            _stream(g, principal, rh, _snapshot(g, rh, stored), -1, None,
                    cancel=not body.background),
            media_type="text/event-stream", headers={**headers, "Cache-Control": "no-store"})
    if body.background:
        return json_response(_object(g, rh, b"", stored), headers=headers)
    ended = await _to_end_unless_gone(g, principal, rh, request)
    if ended is None:
        return Response(status_code=499)  # nobody reads it: the client left
    return json_response(_object(g, *ended, stored), headers=headers)


@router.post("/v1/responses/input_tokens")
async def response_input_tokens(body: ResponseRequest, principal: Principal = Caller,
                                g: Gateway = Service, st: ResponseStore = Store) -> Response:
    """The prompt tokens of the response ``body`` would create: its instructions, the
    previous response's conversation and its input (a dry run, gateway/dry.py)."""
    context = (await _context(g, st, principal, body.previous_response_id)
               if body.previous_response_id else [])
    try:
        n = await routes_tokens.input_tokens(g, body.chat(context), principal,
                                             allow_media=True)
    except ApiError as exc:
        raise reworded(exc) from None
    return json_response({"object": "response.input_tokens", "input_tokens": n})


async def _to_end_unless_gone(g: Gateway, principal: Principal, rh: wire.Header,
                              request: Request) -> tuple[wire.Header, bytes] | None:
    """The request's end, or None when its client left first.  A request that did not
    end (the client left, an error, this handler cancelled) is cancelled on the device:
    a response that is neither streamed nor in the background lives as long as the
    connection that waits for it (docs/api.md)."""
    reading = asyncio.ensure_future(_to_end(g, principal, rh))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((reading, gone), return_when=asyncio.FIRST_COMPLETED)
        return reading.result() if reading.done() else None
    finally:
        gone.cancel()
        if not reading.done() or reading.cancelled() or reading.exception() is not None:
            reading.cancel()
            await calls.cancel_quietly(g, principal, rh)


async def _client_gone(request: Request) -> None:
    """Returns when the client closed its connection (the body was read before the
    route ran, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _context(g: Gateway, st: ResponseStore, principal: Principal, prev: str
                   ) -> list[dict[str, Any]]:
    """The conversation ``prev`` ended: its context, its input and its output, as items."""
    param = "previous_response_id"
    epoch, identity = _own(st, principal, prev, param)
    last, data = await _read(g, principal, prev, epoch, identity, param)
    if not wire.Phase(last.phase).terminal:
        raise ApiError(400, f"previous response {prev!r} has not ended yet; continue it "
                            "once it has", param=param)
    stored = st.get(principal.id, epoch, identity)
    if stored is None or not stored.echo:
        raise ApiError(404, f"previous response {prev!r} was not stored (store: false, or "
                            "not created on /v1/responses)", param=param)
    return [*stored.context, *stored.input, *output_items(last, data)]


# -- the stream -------------------------------------------------------------------------------
async def _stream(g: Gateway, principal: Principal, rh: wire.Header, snapshot: Snapshot,
                  after: int, first: tuple[wire.Header, bytes] | None, cancel: bool
                  ) -> AsyncIterator[bytes]:
    """The response's events after number ``after``; an error that comes once the stream
    has started is ``data: {"error": ...}`` (the SDK raises it; resume after the last
    event seen)."""
    events = Events(first[0] if first else rh, snapshot)
    done, offset = False, 0
    try:
        for ev in events.start(rh):
            if ev["sequence_number"] > after:
                yield sse(ev["type"], dumps(ev))
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0, first):
            out = events.feed(data, last.submit_flags)
            offset += len(data)
            if wire.Phase(last.phase).terminal and offset >= last.total:
                out += events.end(last)
            sent = [ev for ev in out if ev["sequence_number"] > after]
            for ev in sent:
                yield sse(ev["type"], dumps(ev))
            if not out:
                yield b": keep-alive\n\n"
        done = True
    except ApiError as exc:
        yield sse_data(exc.body())
    finally:
        if cancel and not done:
            await calls.cancel_quietly(g, principal, rh)


# -- GET, cancel, delete, input items ---------------------------------------------------------
@router.get("/v1/responses/{rid}", response_model=S.ResponseObject, responses=_SSE)
async def retrieve_response(rid: str, stream: bool = False, starting_after: int | None = None,
                            principal: Principal = Caller, g: Gateway = Service,
                            st: ResponseStore = Store) -> Response:
    epoch, identity = _own(st, principal, rid)
    if starting_after is not None and (not stream or starting_after < 0):
        raise ApiError(400, "starting_after is an event's sequence_number (0 or more), with "
                            "stream=true", param="starting_after")
    if not stream:
        last, data = await _read(g, principal, rid, epoch, identity)
        return json_response(_object(g, last, data, _stored(st, principal, epoch, identity)))
    try:  # errors before the stream opens are HTTP statuses
        first = await calls.read(g, principal, epoch, identity, 0)
    except ApiError as exc:
        raise _named(exc, rid) from None
    snapshot = _snapshot(g, first[0], _stored(st, principal, epoch, identity))
    return StreamingResponse(
        _stream(g, principal, first[0], snapshot,
                -1 if starting_after is None else starting_after, first, cancel=False),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store",
                 "X-Request-Id": ids.format_request_id(epoch, identity)})


@router.post("/v1/responses/{rid}/cancel", response_model=S.ResponseObject)
async def cancel_response(rid: str, principal: Principal = Caller, g: Gateway = Service,
                          st: ResponseStore = Store) -> Response:
    """Cancel, then answer the response once it stopped (the device stops it at its next
    step), or as it is after :data:`CANCEL_WAIT_S`."""
    epoch, identity = _own(st, principal, rid)
    try:
        rh = await calls.cancel(g, principal, epoch, identity)
    except ApiError as exc:
        raise _named(exc, rid) from None
    try:
        async with asyncio.timeout(CANCEL_WAIT_S):
            last, data = await _to_end(g, principal, rh)
    except TimeoutError:
        last, data = await _read(g, principal, rid, epoch, identity)
    return json_response(_object(g, last, data, _stored(st, principal, epoch, identity)))


@router.delete("/v1/responses/{rid}", response_model=S.ResponseDeleted)
async def delete_response(rid: str, principal: Principal = Caller, g: Gateway = Service,
                          st: ResponseStore = Store) -> Response:
    """Cancel the request and forget the response: its stored input and fields go, and a
    tombstone makes the Responses routes answer 404 for it.  The device keeps the output
    bytes until its retention reclaims them (docs/api.md): it has no operation to drop a
    request."""
    epoch, identity = _own(st, principal, rid)
    try:
        await calls.cancel(g, principal, epoch, identity)
    except ApiError as exc:
        raise _named(exc, rid) from None
    st.delete(principal.id, epoch, identity)
    return json_response({"id": rid, "object": "response", "deleted": True})


@router.get("/v1/responses/{rid}/input_items", response_model=S.InputItemList)
async def input_items(rid: str, limit: int = 20, order: str = "desc", after: str | None = None,
                      before: str | None = None, principal: Principal = Caller,
                      g: Gateway = Service, st: ResponseStore = Store) -> Response:
    epoch, identity = _own(st, principal, rid)
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit is 1 to 100", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order is asc or desc", param="order")
    await _read(g, principal, rid, epoch, identity)  # the device's access rule first
    stored = st.get(principal.id, epoch, identity)
    if stored is None or not stored.echo:
        raise ApiError(404, f"response {rid!r} was not stored (store: false, or not created "
                            "on /v1/responses): its input is not kept")
    items = input_item_ids(identity, stored.input)
    if order == "desc":
        items.reverse()
    names = [i["id"] for i in items]
    for cursor, param in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in names:
            raise ApiError(400, f"{param} names no input item of this response", param=param)
    start = names.index(after) + 1 if after is not None else 0
    stop = names.index(before) if before is not None else len(items)
    window = items[start:stop]
    # before alone pages backwards: the page just before the cursor, in the list's order
    page = window[-limit:] if before is not None and after is None else window[:limit]
    return json_response({"object": "list", "data": page,
                          "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None,
                          "has_more": len(window) > len(page)})


# -- retention --------------------------------------------------------------------------------
def _maybe_sweep(g: Gateway, st: ResponseStore) -> None:
    """Check old rows against the device, at most once a minute, beside the request."""
    now = time.monotonic()
    if now - st.last_sweep < SWEEP_S:
        return
    st.last_sweep = now
    task = asyncio.ensure_future(sweep(g, st))
    g.background.add(task)
    task.add_done_callback(g.background.discard)


async def sweep(g: Gateway, st: ResponseStore) -> int:
    """Remove the rows whose request the device no longer holds; how many went.  Every
    due row is checked, a batch at a time: at one batch a minute, a gateway answering
    more than a response a second would outgrow the device's retention."""
    if g.info is None:
        return 0
    gone = 0
    while True:
        due = st.due(g.epoch, g.info.retention_seconds)
        for pid, epoch, identity in due:
            if pid in g.principals:
                try:
                    rh, _ = await g.call(wire.Header(op=wire.Op.READ, principal=pid,
                                                     epoch=epoch, identity=identity))
                except ApiError:
                    return gone  # the device is away: next time
                lost = rh.status in (404, 410)
            else:
                lost = True  # no live token: nobody can read it (a new grant hides it too)
            st.checked(epoch, identity, lost)
            gone += lost
        if len(due) < SWEEP_ROWS:  # a checked row is not due again for a minute
            return gone
        await asyncio.sleep(0)  # the rows without a token need no await: let others run


__all__ = ["router", "response_id", "sweep"]
