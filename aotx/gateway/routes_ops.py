"""Operations: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from .. import wire
from . import schemas as S
from .broker_client import BrokerUnavailable
from .render import json_response, render_metrics
from .service import Caller, Gateway, Principal, Service

router = APIRouter(tags=["operations"], redirect_slashes=False)


@router.get("/healthz", response_model=S.Health)
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz", response_model=S.Ready,
            responses={503: {"model": S.Ready, "description": "not ready"}})
async def readyz(g: Gateway = Service) -> Response:
    try:
        info = wire.Header(op=wire.Op.INFO)
        h, _ = await g.broker.call(info, timeout=g.deadlines.of(info))
        ok = h.status == 200 and g.info is not None
    except BrokerUnavailable:
        ok = False
    return json_response({"status": "ready" if ok else "not ready",
                          "runtime_epoch": str(g.epoch)}, 200 if ok else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(principal: Principal = Caller, g: Gateway = Service) -> Response:
    _, body = await g.ask(wire.Header(op=wire.Op.METRICS, principal=principal.id))
    device = orjson.loads(body)
    bh, bbody = await g.call(wire.Header(op=wire.Op.BROKER_STATS))
    broker = orjson.loads(bbody) if bh.status == 200 else {}
    return Response(render_metrics(device, broker, g.broker.packets_sent,
                                   g.broker.waits_sent),
                    media_type="text/plain; version=0.0.4; charset=utf-8")
