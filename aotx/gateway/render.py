"""Rendering: JSON responses, SSE events, Prometheus text, and the JSON documents built
from wire values (request state, media sources, the policy status, model entries).

Every JSON body the gateway writes goes through :func:`json_response` (orjson, no
framework encoder), so a route, the exception handlers and the guard's routes answer alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Send

from .. import ids, wire
from .errors import INTERNAL, NOT_JSON, ApiError, error_body, wording
from .validation import explain

PHASE_NAMES = {p: p.name.lower() for p in wire.Phase}
FINISH_NAMES = {wire.Finish.NONE: None, wire.Finish.STOP: "stop", wire.Finish.LENGTH: "length"}
JSON = "application/json"


def finish_reason(h: wire.Header) -> str:
    """A finished request's OpenAI ``finish_reason``: ``stop`` unless it hit its limit."""
    return FINISH_NAMES[wire.Finish(h.finish)] or "stop"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type=JSON)


def failure_response(exc: Exception) -> Response:
    """The answer to what a route raised, for the app's handlers and the guard's routes
    alike: an ApiError's standard object; anything else is a bug, answered with the
    standard object and a fixed message, never the exception's text (it may hold a
    path), and ``Connection: close`` (uvicorn closes it after logging the traceback, so
    a pooled client opens a new one instead of failing its next request)."""
    if isinstance(exc, ApiError):
        return error_response(exc)
    return json_response(error_body(500, INTERNAL), 500, {"Connection": "close"})


def invalid_body(annotation: Any, errors: Sequence[Any]) -> ApiError:
    """A body that does not validate as ``annotation``: pydantic's ``errors`` (their
    ``loc`` starting at ``"body"``, as FastAPI reports them) as one 400 and its ``param``."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, NOT_JSON)
    message, param = explain(annotation, errors)
    return ApiError(400, message, param=param)


def error_response(exc: ApiError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers or None)


async def send_json(send: Send, status: int, body: bytes,
                    headers: dict[str, str] | None = None) -> None:
    """A JSON response sent as raw ASGI messages: for the guard, below the framework."""
    raw = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def sse(event: str | None, data: bytes, event_id: str | None = None) -> bytes:
    """One SSE event.  ``event`` and ``event_id`` are ours (no newlines in them); ``data``
    is compact JSON, one line."""
    out = b""
    if event:
        out += b"event: " + event.encode() + b"\n"
    if event_id:
        out += b"id: " + event_id.encode() + b"\n"
    return out + b"data: " + data + b"\n\n"


def sse_data(obj: Any) -> bytes:
    """A standard (OpenAI) stream event: ``data: {json}``."""
    return b"data: " + dumps(obj) + b"\n\n"


def usage(h: wire.Header) -> dict[str, int]:
    return {"prompt_tokens": h.prompt_tokens, "completion_tokens": h.sampled_tokens,
            "total_tokens": h.prompt_tokens + h.sampled_tokens}


def _text(raw: list[int]) -> str:
    return bytes(raw).decode("utf-8", errors="replace")


def token_logprob(n: dict[str, Any]) -> dict[str, Any]:
    """One annotation line (engine/logprobs.py) as OpenAI's ``logprobs.content`` item."""
    return {"token": _text(n["bytes"]), "logprob": n["logprob"], "bytes": n["bytes"],
            "top_logprobs": [{"token": _text(b), "logprob": lp, "bytes": b}
                             for _, lp, b in n["top"]]}


def native_token(n: dict[str, Any]) -> dict[str, Any]:
    """One annotation line as the native ``aotx.logprobs.v1`` item: OpenAI's, with token
    ids and the token's byte offset in the output."""
    return {"token": _text(n["bytes"]), "token_id": n["token"], "offset": n["offset"],
            "logprob": n["logprob"], "bytes": n["bytes"],
            "top_logprobs": [{"token": _text(b), "token_id": t, "logprob": lp, "bytes": b}
                             for t, lp, b in n["top"]]}


def failure(h: wire.Header) -> dict[str, Any] | None:
    """The error object of a failed request (its status at 96, its reason at 28)."""
    if h.phase != wire.Phase.FAILED:
        return None
    message, code, _ = wording(h)
    return error_body(h.failure or 500, message, code=code)["error"]


def state_fields(h: wire.Header, by_role: dict[int, wire.ModelInfo]) -> dict[str, Any]:
    """The state of the request a reply describes (``aotx.request.v1`` without output)."""
    m = by_role.get(h.role)
    return {
        "id": ids.format_request_id(h.epoch, h.identity),
        "runtime_epoch": str(h.epoch),
        "model": m.alias if m else None,
        "model_role": h.role,
        "state": PHASE_NAMES[wire.Phase(h.phase)],
        "cancel_requested": bool(h.cancel_requested),
        "finish_reason": FINISH_NAMES[wire.Finish(h.finish)],
        "failure": failure(h),
        "usage": usage(h),
        "tools": bool(h.submit_flags & wire.SUBMIT_FLAG_TOOLS),
    }


def media_json(h: wire.Header, meta: wire.MediaMeta) -> dict[str, Any]:
    """``aotx.media.v1`` for a reply about one source (its id in ``identity``)."""
    reason = wording(h)[0] if meta.state is wire.MediaState.REFUSED else None
    return media_row(h.source_id, meta, reason)


def media_row(source_id: bytes, meta: wire.MediaMeta, reason: str | None = None) -> dict[str, Any]:
    return {"schema": "aotx.media.v1", "id": f"src-{source_id.hex()}",
            "digest": f"sha256:{meta.digest.hex()}",
            "kind": wire.PART_MODALITY[meta.kind],
            "content_type": wire.MEDIA_TYPES[meta.content_type], "bytes": str(meta.size),
            "state": meta.state.name.lower(), "reason": reason, "leases": meta.leases,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(meta.created_ms / 1000))}


def policy_json(h: wire.Header, body: bytes) -> dict[str, Any]:
    st = wire.decode_policy_status(body)
    return {"schema": "aotx.policy.v1", "runtime_epoch": str(h.epoch),
            "mode": "automatic_memory" if st.mode == 1 else str(st.mode), "abi": st.abi,
            "state": st.state.name.lower(), "review_enabled": bool(st.review_enabled),
            "pending": st.pending, "active_rows": st.active_rows,
            "result_status": st.result_status, "control_revision": str(st.control_revision),
            "source_frontier": str(st.source_frontier), "completed": str(st.completed),
            "interrupted": str(st.interrupted), "refused": str(st.refused),
            "decision": str(st.decision), "saved_generation": str(st.saved_generation),
            "max_ns": str(st.max_ns), "last_ns": str(st.last_ns),
            "written_bytes": str(st.written_bytes), "result_bytes": str(st.result_bytes),
            "reason": st.reason.name.lower()}


def model_entry(m: wire.ModelInfo, residency: dict[str, Any] | None) -> dict[str, Any]:
    return {"alias": m.alias, "role": m.role, "model_sha256": m.sha256.hex(),
            "input_modalities": wire.modality_names(m.modalities),
            "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.published_at)),
            "context_tokens": str(m.context_tokens), "automatic_memory": m.automatic_memory,
            **capabilities(m), "status": model_status(residency)}


def openai_model(m: wire.ModelInfo, residency: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": m.alias, "object": "model", "created": m.published_at, "owned_by": "aotx",
            "automatic_memory": m.automatic_memory, **capabilities(m),
            "status": model_status(residency)}


def model_status(e: dict[str, Any] | None) -> dict[str, Any] | None:
    """A model's residency (the device's MODELS entry) as the routes show it, in
    llama-server's router shape (``status.value``) with aotx's figures beside it; None
    before the device has said (an older device)."""
    if e is None:
        return None
    return {"value": e["state"], "reason": e["reason"], "on_demand": e["on_demand"],
            "file_bytes": e["file_bytes"], "memory_bytes": e["memory_bytes"],
            "vram_bytes": e.get("vram_bytes", 0),
            "sha256": e["sha256"], "keep_alive": e["keep_alive"],
            "expires_in": e["expires_in"]}


def capabilities(m: wire.ModelInfo) -> dict[str, Any]:
    """Which standard routes a model answers: chat (an embedding model's context is 0),
    embeddings with their dimensions and input limit (null: none), rerank (a reranker
    answers that alone); how its chat template writes tools (``fallback``: it knows none,
    aotx writes them as text)."""
    embeds = m.embedding_dims and not m.rerank
    return {"chat": m.context_tokens > 0, "tool_format": m.tool_format.name.lower(),
            "embeddings": {"dimensions": m.embedding_dims,
                           "max_input_tokens": m.embedding_tokens} if embeds else None,
            "rerank": m.rerank}


# -- /metrics: Prometheus text from the device's METRICS and the broker's BROKER_STATS --------

_MODEL_FAMILIES = (  # (key in the device's per-model counters, name, help, counter?)
    ("prompt_tokens", "aotx_prompt_tokens", "Prompt tokens evaluated", True),
    ("completion_tokens", "aotx_completion_tokens", "Tokens generated", True),
    ("steps", "aotx_scheduler_steps", "Decode steps (device tick)", True),
    ("queue_depth", "aotx_queue_depth", "Requests waiting for a slot", False),
    ("active_slots", "aotx_active_slots", "Sequences in the batch", False),
    ("grammar_steps", "aotx_grammar_steps", "Decode steps with constrained samples", True),
    ("grammar_masks", "aotx_grammar_masks", "Token masks of constrained samples", True),
    ("grammar_fill_seconds", "aotx_grammar_fill_seconds",
     "Time the mask worker spent filling masks (beside the decode)", True),
    ("grammar_wait_seconds", "aotx_grammar_wait_seconds",
     "Time the engine thread still waited for masks after the decode", True),
    ("grammar_deferred", "aotx_grammar_deferred",
     "Constrained rows held back a step: their principal's masks had used their share", True),
    ("kv_budget_bytes", "aotx_kv_budget_bytes", "Bytes of the model's KV pool", False),
    ("kv_cells", "aotx_kv_cells", "Cells (tokens) of the model's KV pool", False),
    ("kv_cells_used", "aotx_kv_cells_used",
     "KV cells held by running sequences and cached prefixes (an upper bound)", False),
    ("kv_preemptions", "aotx_kv_preemptions",
     "Requests that gave their KV cells back under pressure (recomputed later)", True),
    ("kv_evictions", "aotx_kv_evictions", "Cached prefixes given back for KV cells", True),
    ("kv_spilled_bytes", "aotx_kv_spilled_bytes",
     "Host memory held by cached prefixes saved from reused sequences", False),
    ("kv_spills", "aotx_kv_spills", "Cached prefixes saved to host memory", True),
    ("kv_restores", "aotx_kv_restores", "Cached prefixes restored from host memory", True),
    ("engine_threads", "aotx_engine_threads",
     "ggml threads a decode runs on now (fewer while other processes keep cores busy)", False),
    ("engine_thread_changes", "aotx_engine_thread_changes",
     "Times the decode's thread count followed the free cores", True),
)
#: The same figures under vLLM's names and its ``model_name`` label, for a router's
#: scorers that read vLLM (llm-d's queue, KV and prefix scorers: docs/scale-out.md).
_VLLM_FAMILIES = (
    ("num_requests_running", "vllm:num_requests_running", "Requests being decoded", False),
    ("num_requests_waiting", "vllm:num_requests_waiting", "Requests waiting to start", False),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "Share of KV cache in use (0-1)",
     False),
    ("prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache", True),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
     True),
)
_HISTOGRAMS = (("ttft_seconds", "aotx_time_to_first_token_seconds", "Admission to first token"),
               ("inter_token_seconds", "aotx_inter_token_seconds",
                "Time between tokens of one request"))


def render_metrics(device: dict[str, Any], broker: dict[str, Any], gateway_packets: int,
                   gateway_waits: int = 0) -> bytes:
    """Prometheus text exposition of the device's and the broker's counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    class Snapshot:
        def collect(self) -> Any:
            yield from _request_families(device)
            yield from _model_families(device["models"])
            yield from _transport_families(device, broker, gateway_packets, gateway_waits)
            yield from _on_demand_families(device.get("on_demand", {}))

    registry = CollectorRegistry()
    registry.register(Snapshot())
    return bytes(generate_latest(registry))


#: The states of a model loaded on first use (device/ondemand.py).
MODEL_STATES = ("unloaded", "loading", "loaded", "unloading", "failed")


def _on_demand_families(models: dict[str, Any]) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    state = GaugeMetricFamily("aotx_model_state", "A model loaded on first use: 1 for its "
                              "state now", labels=["model", "state"])
    loads = CounterMetricFamily("aotx_model_loads", "Loads of a model loaded on first use",
                                labels=["model"])
    seconds = CounterMetricFamily("aotx_model_load_seconds", "Time its loads took",
                                  labels=["model"])
    memory = GaugeMetricFamily("aotx_model_memory_bytes", "Its memory once loaded, as "
                               "estimated from its GGUF header", labels=["model"])
    vram = GaugeMetricFamily("aotx_model_vram_bytes", "The part of that estimate on the "
                             "GPU (its gpu_layers)", labels=["model"])
    evictions = CounterMetricFamily("aotx_model_evictions", "Unloads of a model to make "
                                    "room for another under the memory budget",
                                    labels=["model"])
    for alias, m in sorted(models.items()):
        for name in MODEL_STATES:
            state.add_metric([alias, name], float(m["state"] == name))
        loads.add_metric([alias], m["loads"])
        seconds.add_metric([alias], m["load_seconds"])
        memory.add_metric([alias], m["memory_bytes"])
        vram.add_metric([alias], m.get("vram_bytes", 0))
        evictions.add_metric([alias], m.get("evictions", 0))
    yield from (state, loads, seconds, memory, vram, evictions)


def _request_families(device: dict[str, Any]) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    g = GaugeMetricFamily("aotx_requests", "Requests held by the device, by state",
                          labels=["state"])
    for state, n in sorted(device["requests_by_state"].items()):
        g.add_metric([state], n)
    yield g
    c = CounterMetricFamily("aotx_requests_admitted", "Requests admitted this epoch")
    c.add_metric([], device["admitted"])
    yield c
    c = CounterMetricFamily("aotx_requests_refused", "Submissions refused, by status",
                            labels=["status"])
    for status, n in sorted(device["refused"].items()):
        c.add_metric([status], n)
    yield c


def _model_families(models: dict[str, Any]) -> Any:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    for families, label in ((_MODEL_FAMILIES, "model"), (_VLLM_FAMILIES, "model_name")):
        for key, name, doc, counter in families:
            fam = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc,
                                                                          labels=[label])
            for alias, m in sorted(models.items()):
                if key in m:  # (an engine reports the figures it has: vLLM no grammar masks)
                    fam.add_metric([alias], m[key])
            yield fam
    finished = CounterMetricFamily("aotx_requests_finished", "Requests that ended",
                                   labels=["model", "state"])
    for alias, m in sorted(models.items()):
        for state, n in sorted(m["finished"].items()):
            finished.add_metric([alias, state], n)
    yield finished
    for key, name, doc in _HISTOGRAMS:  # one family each, a sample set per model
        hist = HistogramMetricFamily(name, doc, labels=["model"])
        for alias, m in sorted(models.items()):
            h = m[key]
            acc, buckets = 0, []
            for le, n in zip([*map(str, h["buckets"]), "+Inf"], h["counts"], strict=True):
                acc += n
                buckets.append((le, acc))
            hist.add_metric([alias], buckets, h["sum"])
        yield hist


def _transport_families(device: dict[str, Any], broker: dict[str, Any],
                        gateway_packets: int, gateway_waits: int) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    g = GaugeMetricFamily("aotx_mailboxes", "Broker mailboxes by use", labels=["use"])
    for use in ("free", "in_flight", "orphaned"):
        g.add_metric([use], broker.get(use, 0))
    yield g
    c = CounterMetricFamily("aotx_broker_packets", "Packets relayed by the broker",
                            labels=["kind"])
    for kind in ("packets", "replies", "dropped", "busy"):
        c.add_metric([kind], broker.get(kind, 0))
    yield c
    c = CounterMetricFamily("aotx_gateway_packets", "Packets sent by this gateway")
    c.add_metric([], gateway_packets)
    yield c
    c = CounterMetricFamily("aotx_gateway_waits", "WAITs sent by this gateway, alone or "
                            "grouped in WAITS packets (each member and each resend counted)")
    c.add_metric([], gateway_waits)
    yield c
    g = GaugeMetricFamily("aotx_embed_calls", "EMBED packets the device is computing "
                          "(each holds its mailbox until answered or withdrawn)")
    g.add_metric([], device.get("embed_calls", 0))
    yield g
    g = GaugeMetricFamily("aotx_media_bytes", "Bytes held by media sources")
    g.add_metric([], device.get("media_bytes", 0))
    yield g
    g = GaugeMetricFamily("aotx_service_allocation_bytes", "Bytes the runtime allocated")
    g.add_metric([], device.get("allocation_bytes", 0))
    yield g
