"""Operation 22 (MODELS): every model with its residency, and an admin's load or unload.

A read (no payload) answers, as INFO does, for every model whatever the caller's grant
(the gateway shows each principal the models its grant names): UTF-8 JSON with the
budget and, per model, its state (``unloaded``, ``loading``, ``loaded``, ``unloading``,
``failed`` with the reason), its file's size, its estimated memory, its SHA-256 once
known, its keep-alive and when an idle model unloads.  A model loaded at start is
``loaded`` and pinned.  The models folder's files beyond the role limit are listed
under ``unassigned``: no grant can name them, so nobody can load them.

A control (a JSON payload ``{"alias", "action": "load" | "unload", "cancel"}``) needs the
admin action and the device's epoch.  ``load`` asks for a load as a request would
(the runtime plans the room by the residency rule, device/fleet.py, with the admin as
the principal; an admin does not evict what the rule protects); ``unload`` unloads the
model once its requests have ended, or, with ``cancel``, cancels them first.  Both
answer with the model's entry; the runtime carries them out (device/runtime.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from ..wire import Reason
from .catalog import MAX_ROLE
from .errors import DeviceError
from .ondemand import FAILED, LOADED, LOADING, UNLOADED, OnDemand
from .state import DeviceState

ACTIONS = ("load", "unload")


def file_bytes(path: str) -> int:
    """A model's bytes on disk: its file's, or a model folder's files' (vLLM's); 0 when
    it cannot be read."""
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return os.stat(path).st_size
    except OSError:
        return 0


def _on_demand_entry(od: OnDemand, st: DeviceState, now: float) -> dict[str, Any]:
    m = st.models.get(od.spec.role)
    sha = m.sha256 if m is not None and od.state == LOADED else od.sha256
    idle = m is not None and not st.working(od.spec.role)
    expires = None
    if od.state == LOADED and idle:
        expires = od.resident().expires_in(now)
    return {"alias": od.spec.alias, "role": od.spec.role, "state": od.state,
            "reason": od.reason or None, "on_demand": True,
            "file_bytes": file_bytes(od.spec.path), "memory_bytes": od.memory_bytes,
            "vram_bytes": od.vram_bytes,
            "sha256": sha.hex() if sha else None, "keep_alive": od.spec.keep_alive,
            "expires_in": expires, "unload_asked": od.unload_asked,
            "loads": od.loads, "evictions": od.evictions}


def entries(st: DeviceState, now: float) -> list[dict[str, Any]]:
    """Every model's entry, in role order."""
    out = {role: _on_demand_entry(od, st, now) for role, od in st.on_demand.items()}
    for role, m in st.models.items():
        if role in out:
            continue
        memory = 0 if m.shares_engine else m.engine.model_bytes + m.engine.kv_bytes()
        out[role] = {"alias": m.spec.alias, "role": role, "state": LOADED, "reason": None,
                     "on_demand": False, "file_bytes": file_bytes(m.spec.path),
                     "memory_bytes": memory, "vram_bytes": 0, "sha256": m.sha256.hex(),
                     "keep_alive": -1,
                     "expires_in": None, "unload_asked": False, "loads": 1, "evictions": 0}
    return [out[r] for r in sorted(out)]


def status(st: DeviceState, budget: int, unassigned: list[tuple[str, str]]) -> bytes:
    """The read's payload."""
    listed = entries(st, time.monotonic())
    used = sum(e["memory_bytes"] for e in listed if e["state"] != UNLOADED
               and e["state"] != FAILED)
    return orjson.dumps({
        "budget_bytes": budget, "used_bytes": used, "models": listed,
        "unassigned": [{"alias": a, "path": p, "file_bytes": file_bytes(p),
                        "state": "no_role",
                        "reason": f"all {MAX_ROLE} model roles are given"}
                       for a, p in unassigned]})


def parse_control(payload: bytes) -> tuple[str, str, bool]:
    """(alias, action, cancel) of a control payload; 400 MALFORMED when it is not one."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise DeviceError(400, Reason.MALFORMED) from None
    if (not isinstance(doc, dict) or set(doc) - {"alias", "action", "cancel"}
            or not isinstance(doc.get("alias"), str) or doc.get("action") not in ACTIONS
            or not isinstance(doc.get("cancel", False), bool)):
        raise DeviceError(400, Reason.MALFORMED)
    return doc["alias"], doc["action"], doc.get("cancel", False)


def control(st: DeviceState, alias: str, action: str, cancel: bool, principal: int,
            now: float) -> tuple[OnDemand, list[bytes]]:
    """Ask for ``action`` on the model ``alias`` (lock held): the entry, and the identities
    of the requests cancelled for an unload (their WAITs are to be answered).  404
    NO_MODEL for no such model; 409 MODEL_FIXED for one loaded at start."""
    od = next((o for o in st.on_demand.values() if o.spec.alias == alias), None)
    if od is None:
        if any(m.spec.alias == alias for m in st.models.values()):
            raise DeviceError(409, Reason.MODEL_FIXED)
        raise DeviceError(404, Reason.NO_MODEL)
    cancelled: list[bytes] = []
    if action == "load":
        od.unload_asked = False
        od.ask_load(principal, now, force=True)  # (503 only when its file is gone)
        return od, cancelled
    od.asked, od.asked_by = 0.0, 0
    if od.state in (LOADING, LOADED):
        od.unload_asked = True
    if cancel:
        for req in [r for r in st.requests.values()
                    if r.role == od.spec.role and not r.phase.terminal]:
            st.cancel(req)
            cancelled.append(req.identity)
    return od, cancelled
