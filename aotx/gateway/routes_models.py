"""The models' residency (operation 22): the list with each model's state, and an admin's
load or unload of a model loaded on first use (device/residency.py).

``GET /aotx/v1/models`` lists the models the caller's grant names with their residency
and the memory budget; an admin also sees the models folder's files that have no role.
``POST /aotx/v1/models/{alias}/load`` loads a model as its first request would (202 while
it loads); ``POST .../unload`` unloads it once its requests end, or, with
``{"cancel": true}``, cancels them first.  Both answer with the model's entry.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.responses import Response

from .. import wire
from . import schemas as S
from .body import Body
from .errors import ApiError, refusal
from .render import json_response, model_status
from .service import Caller, Gateway, Principal, Service

router = APIRouter(tags=["models"], redirect_slashes=False)


class UnloadBody(Body):
    cancel: bool = False


def residency_entry(e: dict[str, Any]) -> dict[str, Any]:
    return {"alias": e["alias"], "role": e["role"], "status": model_status(e),
            "loads": e["loads"], "evictions": e["evictions"],
            "unload_asked": e["unload_asked"]}


@router.get("/aotx/v1/models", response_model=S.Models)
async def list_models(principal: Principal = Caller, g: Gateway = Service) -> Response:
    await g.ensure_ready()
    doc = await g.read_residency(g.deadlines.of(wire.Header(op=wire.Op.MODELS)))
    admin = bool(principal.grant.actions & wire.Action.ADMIN)
    mine = [e for e in doc.get("models", ()) if principal.grant.allows_model(e["alias"])]
    # (another caller's figure is its own models': the others' use is theirs)
    used = doc.get("used_bytes", 0) if admin else sum(
        e["memory_bytes"] for e in mine if e["state"] not in ("unloaded", "failed"))
    return json_response({
        "schema": "aotx.models.v1", "budget_bytes": doc.get("budget_bytes", 0),
        "used_bytes": used, "models": [residency_entry(e) for e in mine],
        "unassigned": doc.get("unassigned", []) if admin else None})


async def _control(g: Gateway, principal: Principal, alias: str, action: str,
                   cancel: bool = False) -> Response:
    await g.ensure_ready()
    payload = orjson.dumps({"alias": alias, "action": action, "cancel": cancel})
    rh, body = await g.call(wire.Header(op=wire.Op.MODELS, principal=principal.id,
                                        epoch=g.epoch), payload)
    if rh.status == 404:
        raise ApiError(404, f"the model {alias!r} does not exist", param="model",
                       code="model_not_found")
    if rh.status != 200:
        raise refusal(rh)
    entry = orjson.loads(body)
    g.residency["models"] = [entry if e["alias"] == alias else e
                             for e in g.residency.get("models", ())]
    done = entry["state"] == ("loaded" if action == "load" else "unloaded")
    return json_response(residency_entry(entry), 200 if done else 202)


@router.post("/aotx/v1/models/{alias:path}/load", response_model=S.ResidencyEntry,
             responses={202: {"description": "the load has started, or waits for room"}})
async def load_model(alias: str, principal: Principal = Caller,
                     g: Gateway = Service) -> Response:
    """Load a model loaded on first use now (the grant needs the ``admin`` action)."""
    return await _control(g, principal, alias, "load")


@router.post("/aotx/v1/models/{alias:path}/unload", response_model=S.ResidencyEntry,
             responses={202: {"description": "it unloads once its requests have ended"}})
async def unload_model(alias: str, body: UnloadBody | None = None,
                       principal: Principal = Caller, g: Gateway = Service) -> Response:
    """Unload a model loaded on first use once its requests end; ``cancel``: cancel them
    first (the grant needs the ``admin`` action)."""
    return await _control(g, principal, alias, "unload", body is not None and body.cancel)
