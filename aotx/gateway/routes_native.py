"""The native request routes (the seed's client sequence): capabilities, admission,
windows, events, cancellation and telemetry."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .. import config, ids, wire
from . import calls
from . import schemas as S
from .errors import ApiError, guard_only
from .render import dumps, json_response, model_entry, sse, state_fields
from .requests import MAX_CHOICES, ChatRequest, b64
from .service import Caller, Gateway, Principal, Service, parse_id

router = APIRouter(tags=["native"], redirect_slashes=False)


@router.get("/aotx/v1/capabilities", response_model=S.Capabilities)
async def capabilities(principal: Principal = Caller, g: Gateway = Service) -> Response:
    await g.ensure_ready()
    info = g.info
    assert info is not None
    memory = any(m.automatic_memory for m in info.models)
    return json_response({
        "schema": "aotx.capabilities.v1",
        "runtime_epoch": str(info.epoch),
        "device_id": str(ids.device_of(info.epoch)),
        "limits": {
            "max_packet_bytes": str(info.max_packet), "max_payload_bytes": str(info.max_payload),
            "window_bytes": str(info.window_bytes), "context_tokens": str(info.context_tokens),
            "output_tokens": str(info.output_tokens),
            "active_requests": str(info.active_requests), "slots": str(info.slots),
            "kv_cells": str(info.kv_cells),
            "media_bytes": str(info.media_bytes), "body_bytes": str(g.settings.max_body),
            "retention_seconds": str(info.retention_seconds),
            "retention_requests": str(info.retention_requests),
            "constraint_bytes": str(config.MAX_CONSTRAINT_BYTES),
            "constraint_depth": str(config.MAX_SCHEMA_DEPTH),
            "choices": str(MAX_CHOICES),
            "embedding_inputs": str(wire.MAX_EMBED_INPUTS),
        },
        "models": [model_entry(m, g.model_state(m.alias)) for m in g.visible_models(principal)],
        # Every native function; false exactly when no route provides it.
        "features": {"requests": True, "windows": True, "events": True, "cancel": True,
                     "media": True, "telemetry": True, "metrics": True, "policy": True,
                     "automatic_memory": memory, "shared_operations": False,
                     "response_format": ["text", "json_object", "json_schema"],
                     "tool_choice": ["none", "auto", "required", "function"],
                     "top_logprobs": wire.MAX_TOP_LOGPROBS,
                     "embeddings": any(m.embedding_dims and not m.rerank
                                       for m in info.models),
                     "rerank": any(m.rerank for m in info.models)},
        "lineage": {"kind": "automatic_memory", "path": "memory/"} if memory else None,
    })


@router.post("/aotx/v1/requests", status_code=202, response_model=S.Admission)
async def submit(body: ChatRequest, principal: Principal = Caller) -> Response:
    # Admit a request (calls.admission_body). The guard answers every request to this
    # path; this declaration is its OpenAPI entry.
    raise guard_only("POST /aotx/v1/requests")


@router.get("/aotx/v1/requests/{rid}", response_model=S.RequestWindow)
async def get_request(rid: str, cursor: str | None = None,
                      principal: Principal = Caller) -> Response:
    # A window of the request's output (calls.window_body). The guard answers every
    # request to this path; this declaration is its OpenAPI entry.
    raise guard_only("GET /aotx/v1/requests/{rid}")


@router.get("/aotx/v1/requests/{rid}/logprobs", response_model=S.RequestLogprobs)
async def get_logprobs(rid: str, cursor: str | None = None, principal: Principal = Caller,
                       g: Gateway = Service) -> Response:
    """A window of the request's per-token logprobs (it asked ``logprobs``), from
    ``cursor`` (0, or a ``next_cursor``), during generation or after it."""
    return Response(await calls.logprobs_body(g, principal, rid, cursor),
                    media_type="application/json")


@router.get("/aotx/v1/requests/{rid}/tool_calls", response_model=S.RequestToolCalls)
async def get_tool_calls(rid: str, principal: Principal = Caller,
                         g: Gateway = Service) -> Response:
    """The request's output parsed into text and tool calls (it offered ``tools``), as
    ``POST /v1/chat/completions`` answers it, the calls' ids alike; while it runs, the
    calls complete so far."""
    return Response(await calls.message_body(g, principal, rid, "aotx.tool_calls.v1"),
                    media_type="application/json")


@router.get("/aotx/v1/requests/{rid}/message", response_model=S.RequestMessage)
async def get_message(rid: str, principal: Principal = Caller,
                      g: Gateway = Service) -> Response:
    """The request's output parsed as ``POST /v1/chat/completions`` answers it: a thinking
    model's thinking as ``reasoning_content``, tool calls where it offered tools, the rest
    as ``content``; while it runs, what it has written so far."""
    return Response(await calls.message_body(g, principal, rid, "aotx.message.v1"),
                    media_type="application/json")


@router.post("/aotx/v1/requests/{rid}/cancel", status_code=202, response_model=S.RequestState)
async def cancel_request(rid: str, principal: Principal = Caller,
                         g: Gateway = Service) -> Response:
    epoch, identity = parse_id(rid)
    rh = await calls.cancel(g, principal, epoch, identity)
    return json_response({"schema": "aotx.request.v1", **state_fields(rh, g.by_role)}, 202)


@router.post("/aotx/v1/admin/requests/{rid}/cancel", status_code=202,
             response_model=S.RequestState)
async def admin_cancel_request(rid: str, principal: Principal = Caller,
                               g: Gateway = Service) -> Response:
    """Cancel any principal's request (the grant needs the ``admin`` action)."""
    epoch, identity = parse_id(rid)
    rh = await calls.cancel(g, principal, epoch, identity, admin=True)
    return json_response({"schema": "aotx.request.v1", **state_fields(rh, g.by_role)}, 202)


@router.get("/aotx/v1/requests/{rid}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "SSE: emission, status and error events"}})
async def events(rid: str, request: Request, cursor: str | None = None,
                 principal: Principal = Caller, g: Gateway = Service) -> Response:
    last = request.headers.get("last-event-id")
    if cursor is not None and last is not None:
        raise ApiError(400, "give ?cursor or Last-Event-ID, not both", param="cursor")
    epoch, identity = parse_id(rid)
    pos = calls.parse_cursor(cursor)
    if last is not None:
        lid, sep, lcur = last.strip().rpartition(":")
        if not sep or lid != rid:
            raise ApiError(400, "Last-Event-ID does not name this request",
                           param="Last-Event-ID")
        pos = calls.parse_cursor(lcur, "Last-Event-ID")
    first = await calls.read(g, principal, epoch, identity, pos)  # errors: HTTP statuses
    return StreamingResponse(_event_stream(g, principal, rid, pos, first),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def _event_stream(g: Gateway, principal: Principal, rid: str, pos: int,
                        first: tuple[wire.Header, bytes]) -> AsyncIterator[bytes]:
    """Emissions as the bytes come, a status when the state changes, exactly one terminal
    status after the last bytes; an error in-band (the response has started)."""
    offset = pos
    epoch, identity = first[0].epoch, first[0].identity

    def status(rh: wire.Header) -> bytes:
        return sse("status", dumps({"schema": "aotx.status.v1", **state_fields(rh, g.by_role)}))

    try:
        async for rh, data, changed in calls.follow(g, principal, epoch, identity, pos, first):
            if data:
                nxt = offset + len(data)
                yield sse("emission", dumps(_emission(rid, rh, offset, nxt, data)), f"{rid}:{nxt}")
                offset = nxt
            terminal = wire.Phase(rh.phase).terminal
            if terminal and offset >= rh.total:
                yield status(rh)
                return
            if changed and not terminal:
                yield status(rh)
            elif not data and not changed:
                yield b": keep-alive\n\n"
    except ApiError as exc:
        yield sse("error", dumps(exc.body()))


def _emission(rid: str, rh: wire.Header, offset: int, nxt: int, data: bytes) -> dict[str, Any]:
    return {"schema": "aotx.emission.v1", "request_id": rid, "runtime_epoch": str(rh.epoch),
            "source_kind": "model", "model_role": rh.role, "offset": str(offset),
            "next_cursor": str(nxt), "encoding": "base64", "bytes": b64(data)}


@router.get("/aotx/v1/telemetry", response_model=S.Telemetry)
async def telemetry(principal: Principal = Caller, g: Gateway = Service) -> Response:
    rh, body = await g.ask(wire.Header(op=wire.Op.TELEMETRY, principal=principal.id))
    t = wire.decode_telemetry(body)
    return json_response({"schema": "aotx.telemetry.v1", "runtime_epoch": str(rh.epoch),
                          "sample": {"service_allocation_bytes": str(t.allocation_bytes),
                                     "device_tick": str(t.tick),
                                     "device_clock_ns": str(t.clock_ns)},
                          "affect": None, "expression": None})
