"""The resident policy (operation 12) and the caller's automatic memory."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.responses import Response

from .. import wire
from . import schemas as S
from .errors import ApiError, refusal
from .render import json_response, policy_json
from .requests import PolicyControlBody
from .service import Caller, Gateway, Principal, Service

router = APIRouter(tags=["policy"], redirect_slashes=False)
_DECIMAL = frozenset("0123456789")


@router.get("/aotx/v1/policy", response_model=S.Policy)
async def get_policy(principal: Principal = Caller, g: Gateway = Service) -> Response:
    rh, body = await g.ask(wire.Header(op=wire.Op.POLICY, principal=principal.id))
    return json_response(policy_json(rh, body))


@router.post("/aotx/v1/policy", response_model=S.Policy)
async def control_policy(body: PolicyControlBody, principal: Principal = Caller,
                         g: Gateway = Service) -> Response:
    action = wire.PolicyAction[body.action.replace("-", "_").upper()]
    expected = int(body.expected_revision)
    if expected >= 1 << 64:
        raise ApiError(400, "expected_revision is out of range", param="expected_revision")
    payload = wire.encode_policy_control(wire.PolicyControl(action=action, expected_revision=expected))
    await g.ensure_ready()
    rh, rbody = await g.call(wire.Header(op=wire.Op.POLICY, principal=principal.id,
                                         epoch=g.epoch), payload)
    if rh.status == 409 and rh.reason == wire.Reason.STALE_REVISION:
        raise ApiError(409, f"stale control revision {expected}; the current one is "
                            f"{rh.detail}", param="expected_revision")
    if rh.status != 200:
        raise refusal(rh)
    return json_response(policy_json(rh, rbody))


async def _memory(g: Gateway, principal: Principal, op: wire.MemoryOp,
                  pending_id: int = 0) -> bytes:
    _, body = await g.ask(wire.Header.request(wire.Op.MEMORY, principal=principal.id,
                                               memory_op=int(op), pending_id=pending_id))
    return body


@router.get("/aotx/v1/memory", response_model=S.Memory)
async def read_memory(principal: Principal = Caller, g: Gateway = Service) -> Response:
    doc = wire_json(await _memory(g, principal, wire.MemoryOp.READ))
    return json_response({"schema": "aotx.memory.v1", "generation": str(doc["generation"]),
                          "facts": doc["facts"]})


@router.delete("/aotx/v1/memory", status_code=204)
async def erase_memory(principal: Principal = Caller, g: Gateway = Service) -> Response:
    await _memory(g, principal, wire.MemoryOp.ERASE)
    return Response(status_code=204)


@router.get("/aotx/v1/memory/pending", response_model=S.MemoryPending)
async def pending_memory(principal: Principal = Caller, g: Gateway = Service) -> Response:
    return json_response({"schema": "aotx.memory_pending.v1",
                          "data": wire_json(await _memory(g, principal,
                                                          wire.MemoryOp.PENDING))})


@router.post("/aotx/v1/memory/pending/{pid}/{verdict}", response_model=S.PendingDecision)
async def decide_pending(pid: str, verdict: str, principal: Principal = Caller,
                         g: Gateway = Service) -> Response:
    # The caller is authenticated (the dependency) before anything about the path is said.
    if verdict not in ("approve", "reject"):
        raise ApiError(404, "use .../approve or .../reject")
    if not pid or len(pid) > 20 or not set(pid) <= _DECIMAL or int(pid) >= 1 << 63:
        raise ApiError(404, "no such pending decision")
    op = wire.MemoryOp.APPROVE if verdict == "approve" else wire.MemoryOp.REJECT
    await _memory(g, principal, op, int(pid))
    return json_response({"id": pid, "decision": verdict})


def wire_json(body: bytes) -> Any:
    """A JSON payload of the device (MEMORY replies)."""
    return orjson.loads(body)
