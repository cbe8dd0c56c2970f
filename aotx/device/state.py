"""The device's tables and the lock that guards them.

:class:`DeviceState` holds what the device is the authority for: the grant table with
its revisions, the request table (identity -> engine request) and its retention order,
the loaded models, the media sources and their leases, the resident policy, and the
counters.  The control thread, the engine threads and the media worker share it under
``lock``; the handlers (:mod:`.handlers`, :mod:`.admission`) read and change it and
raise :class:`~aotx.device.errors.DeviceError` to refuse.

Access rule for a request handle, in this order: an ended epoch is 410 for everyone;
a missing action is 403 without looking at the handle; anything that would reveal a
foreign or revoked request is 404 (its principal, its admission revision against the
principal's current one, and the grant's model bit for its role must all match).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import ids, wire
from ..engine.logprobs import window as notes_window
from ..engine.request import Failure, Request, settle
from ..wire import Header, Reason
from .errors import DeviceError
from .loading import LoadedModel
from .media import MediaTable
from .ondemand import LOADED, Deferred, OnDemand
from .policy import Policy

log = logging.getLogger("aotx.device")


@dataclass
class DeviceLimits:
    window_bytes: int = 32768
    max_active: int = 1024  # queued + running, device-wide
    retention_seconds: int = 900
    retention_requests: int = 4096  # terminal results kept, per principal
    max_output_tokens: int = 8192
    media_bytes: int = 64 << 20  # largest single source
    media_total_bytes: int = 1 << 30  # all sources of the activation together
    #: What one principal may hold of a device-wide limit (active requests, media bytes)
    #: unless its grant says otherwise: whatever it does, the rest stays for the others.
    principal_share: float = 0.5
    #: The high 16 bits of every epoch (ids.py): which device of several behind a router
    #: this is (docs/scale-out.md).  Not a limit; it travels with the device's settings.
    device_id: int = 0
    #: Bytes the models' estimated memory may take together (0: fleet.default_budget), and
    #: how long a request waits for room before 503 (models loaded on first use).
    memory_budget: int = 0
    load_wait_seconds: float = 120.0

    def share(self, total: int) -> int:
        return max(1, int(total * self.principal_share))


@dataclass
class Counters:
    admitted: int = 0
    refused: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))


#: What a failed request's reply says: the engine's failure -> (status at 96, reason).
FAILURES: dict[Failure, tuple[int, Reason]] = {
    Failure.NONE: (0, Reason.NONE),
    Failure.NO_MEMORY: (503, Reason.KV_FULL),
    Failure.DECODE: (500, Reason.DECODE),
    Failure.MEDIA: (500, Reason.MEDIA_ENCODE),
    # A grammar's matcher ran past llguidance's per-step limits mid-generation (the
    # request's compile checks passed).
    Failure.GRAMMAR: (500, Reason.GRAMMAR_FAILED),
}


class DeviceState:
    def __init__(self, epoch: int, limits: DeviceLimits, policy: Policy,
                 log_prompts: bool = False) -> None:
        self.epoch = epoch
        self.limits = limits
        self.log_prompts = log_prompts
        self.started_unix_ns = time.time_ns()
        self.clock0 = time.monotonic_ns()
        self.lock = threading.Lock()
        self.requests: collections.OrderedDict[bytes, Request] = collections.OrderedDict()
        # Terminal results in the order they ended, one queue per principal: retention
        # counts each principal's own, so nobody's requests reclaim another's results.
        self.terminal_order: dict[int, collections.deque[bytes]] = {}
        self.active: collections.Counter[int] = collections.Counter()  # principal -> queued+running
        self.grants: dict[int, wire.Grant] = {}
        self.grant_revision = 0
        self.admissions: dict[int, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        self.counters = Counters()
        self.models: dict[int, LoadedModel] = {}
        self.on_demand: dict[int, OnDemand] = {}  # models loaded on first use (ondemand.py)
        self.deferred: dict[bytes, Deferred] = {}  # requests waiting for their model's load
        self.budget = 0  # bytes: the memory budget of the models (the runtime's)
        #: role -> its submissions the media worker holds (tokenizing media or compiling a
        #: constraint without the lock): their model counts as busy (never unloaded)
        self.preparing: collections.Counter[int] = collections.Counter()
        self.unassigned: list[tuple[str, str]] = []  # (alias, path): the folder's, no role
        self.media = MediaTable(limits.media_bytes, limits.media_total_bytes,
                                limits.share(limits.media_total_bytes))
        self.leases: dict[bytes, list[bytes]] = {}  # request identity -> leased source ids
        self.policy = policy

    def request_id(self, identity: bytes) -> str:
        return ids.format_request_id(self.epoch, identity)

    # -- access ------------------------------------------------------------------------
    def grant_for(self, h: Header, action: int) -> wire.Grant:
        """The caller's grant, if it includes ``action`` (403 otherwise)."""
        grant = self.grants.get(h.principal)
        if grant is None:
            raise DeviceError(403, Reason.NO_GRANT)
        if not grant.actions & action:
            raise DeviceError(403, Reason.ACTION, action)
        return grant

    def submit_grant(self, h: Header, embed: bool = False) -> wire.Grant:
        """The caller's grant, if it may submit to the model named by ``h.role`` (``embed``:
        ask it for embeddings; an embedding model takes nothing else)."""
        grant = self.grant_for(h, wire.Action.SUBMIT)
        m = self.models.get(h.role)
        waiting = self.on_demand.get(h.role) if m is None else None
        if waiting is not None and (grant.model_mask >> h.role) & 1:
            if embed:  # (no embedding context until it is loaded: the call asks its load)
                waiting.ask_load(h.principal, time.monotonic())
                raise DeviceError(503, Reason.MODEL_UNLOADED, retry_after=1)
            if waiting.spec.kind == "chat":
                return grant
        if (m is None or not (grant.model_mask >> h.role) & 1
                or not (m.embeddings is not None if embed else m.chat)):
            raise DeviceError(404, Reason.NO_MODEL)
        return grant

    def lookup(self, h: Header, action: int) -> Request:
        """The request ``h`` names, if the caller may act on it (the module's access rule)."""
        if h.epoch != self.epoch:
            if ids.ended(h.epoch, self.epoch):
                raise DeviceError(410, Reason.EPOCH_ENDED)
            raise DeviceError(404, Reason.NO_REQUEST)
        grant = self.grant_for(h, action)
        req = self.requests.get(h.identity)
        if (req is None or req.principal != h.principal or req.revision != grant.revision
                or not (grant.model_mask >> req.role) & 1):
            raise DeviceError(404, Reason.NO_REQUEST)
        return req

    # -- what replies carry -------------------------------------------------------------------
    def state_fields(self, req: Request, notes: bool = False) -> dict[str, Any]:
        """The state a reply carries; ``total``: the annotation stream's bytes with
        ``notes`` (a READ_FLAG_ANNOTATIONS read), else the output's."""
        failure, reason = (req.refused if req.failure is Failure.REFUSED
                           else FAILURES[req.failure])
        return dict(phase=int(req.phase), role=req.role, total=len(notes_of(req))
                    if notes else len(req.out),
                    prompt_tokens=req.prompt_tokens, sampled_tokens=req.sampled,
                    finish=int(req.finish), failure=failure, reason=int(reason),
                    cancel_requested=int(req.cancel_requested), revision=req.revision,
                    flags=req.kept_flags, value=req.stop_hit, limit=req.reasoning_tokens)

    def window(self, req: Request, cursor: int, notes: bool = False, limit: int = 0) -> bytes:
        """The output window at ``cursor``, at most ``limit`` bytes (0: the device's window
        size), 409 past the bytes produced so far; with ``notes``, the annotation stream's
        whole lines from ``cursor`` (409 also when ``cursor`` does not start a line:
        engine/logprobs.py)."""
        limit = min(limit or self.limits.window_bytes, self.limits.window_bytes)
        if notes:
            body = notes_window(notes_of(req), cursor, limit)
        elif cursor <= len(req.out):
            body = bytes(req.out[cursor:cursor + limit])
        else:
            body = None
        if body is None:
            raise DeviceError(409, Reason.CURSOR, fields=self.state_fields(req, notes))
        return body

    def engines(self) -> list[LoadedModel]:
        """The models with an engine of their own: a LoRA adapter shares its base's."""
        return [m for m in self.models.values() if not m.shares_engine]

    def info(self, mailboxes: int) -> wire.Info:
        rows = {m.spec.role: wire.ModelInfo(m.spec.role, m.spec.alias, m.sha256, m.modalities,
                                            m.published_at,
                                            m.engine.slot_context if m.chat else 0,
                                            m.automatic_memory, *_embedding_limits(m),
                                            m.template.tool_format, m.spec.kind == "rerank")
                for m in self.models.values()}
        for role, od in self.on_demand.items():
            rows.setdefault(role, od.info)  # (loaded, the model's own row)
        models = tuple(rows[r] for r in sorted(rows))
        return wire.Info(
            epoch=self.epoch, models=models,
            window_bytes=self.limits.window_bytes,
            context_tokens=models[0].context_tokens if models else 0,
            output_tokens=self.limits.max_output_tokens,
            active_requests=self.limits.max_active,
            slots=sum(m.spec.slots for m in self.engines()),
            media_bytes=self.limits.media_bytes,
            retention_seconds=self.limits.retention_seconds,
            retention_requests=self.limits.retention_requests, mailboxes=mailboxes,
            kv_cells=sum(m.engine.kv_cells for m in self.engines()),
            started_unix_ns=self.started_unix_ns)

    def telemetry(self) -> wire.Telemetry:
        alloc = sum(m.engine.model_bytes + m.engine.kv_bytes() for m in self.engines())
        alloc += sum(len(r.out) + 4 * len(r.prompt) + len(notes_of(r))
                     for r in self.requests.values())
        alloc += self.media.total_bytes
        tick = sum(m.scheduler.tick for m in self.engines())
        return wire.Telemetry(alloc, tick, time.monotonic_ns() - self.clock0)

    def metrics(self, parked_waits: int) -> dict[str, object]:
        by_phase: collections.Counter[str] = collections.Counter(
            r.phase.name.lower() for r in self.requests.values())
        models = {}
        for m in self.engines():  # (a LoRA adapter's load is its base model's)
            sc, stats = m.scheduler, m.scheduler.stats
            models[m.spec.alias] = {
                "queue_depth": len(sc.queue), "active_slots": len(sc.active),
                "slots": m.spec.slots, "steps": sc.tick, "prompt_tokens": stats.prompt_tokens_in,
                "completion_tokens": stats.tokens_out, "finished": dict(stats.finished),
                "ttft_seconds": stats.ttft.snapshot(), "inter_token_seconds": stats.itl.snapshot(),
                **sc.engine_metrics()}
        return {"epoch": self.epoch, "requests_by_state": dict(by_phase),
                "admitted": self.counters.admitted,
                "refused": {str(k): v for k, v in self.counters.refused.items()},
                "models": models, "parked_waits": parked_waits,
                "media_bytes": self.media.total_bytes,
                "allocation_bytes": self.telemetry().allocation_bytes,
                "on_demand": {od.spec.alias: {"state": od.state, "loads": od.loads,
                                              "load_seconds": od.load_seconds,
                                              "memory_bytes": od.memory_bytes,
                                              "vram_bytes": od.vram_bytes,
                                              "evictions": od.evictions}
                              for od in self.on_demand.values()}}

    # -- retention -------------------------------------------------------------------------------
    def reclaim(self, now_ns: int) -> None:
        """Drop terminal results past their retention (time, or each principal's count),
        oldest first."""
        horizon = now_ns - self.limits.retention_seconds * 1_000_000_000
        for principal, order in list(self.terminal_order.items()):
            while order:
                req = self.requests.get(order[0])
                if req is not None and (req.finished_ns > horizon
                                        and len(order) <= self.limits.retention_requests):
                    break
                identity = order.popleft()
                if req is not None:
                    del self.requests[identity]
                    log.debug("event=request.reclaimed id=%s", self.request_id(identity))
            if not order:
                del self.terminal_order[principal]

    def ended(self, req: Request) -> None:
        """A foreground request became terminal: its principal holds one active request
        less, and one more result to retain."""
        self.active[req.principal] -= 1
        if self.active[req.principal] <= 0:
            del self.active[req.principal]
        self.terminal_order.setdefault(req.principal, collections.deque()).append(req.identity)

    def cancel_all(self, principal: int, keep_revision: int = -1) -> list[Request]:
        """Cancel the principal's queued and running requests (but those admitted under
        ``keep_revision``): a revoked or replaced grant can no longer read them."""
        mine = [r for r in self.requests.values() if r.principal == principal
                and not r.phase.terminal and r.revision != keep_revision]
        for r in mine:
            self.cancel(r)
        return mine

    def cancel(self, req: Request) -> None:
        """Ask for ``req``'s end: its engine's, or, while its model loads, at once."""
        deferred = self.deferred.pop(req.identity, None)
        if deferred is None:
            self.models[req.role].scheduler.cancel(req)
            return
        od = self.on_demand[req.role]
        od.waiting = [d for d in od.waiting if d is not deferred]
        req.cancel_requested = True
        settle(req, wire.Phase.CANCELLED, wire.Finish.NONE, Failure.NONE)
        self.ended(req)

    def working(self, role: int) -> bool:
        """Whether ``role``'s model has requests queued or running, or submissions the
        media worker holds for it (lock held): a model that works is not idle."""
        m = self.models.get(role)
        return m is not None and bool(m.scheduler.queue or m.scheduler.active
                                      or self.preparing[role])

    def loaded(self, role: int) -> bool:
        """Whether a SUBMIT for ``role`` is admitted now: its model is loaded and no
        admin asked for its unload (then it waits for the unload, and loads it again)."""
        od = self.on_demand.get(role)
        return od is None or (od.state == LOADED and not od.unload_asked)


def _embedding_limits(m: LoadedModel) -> tuple[int, int]:
    """(floats per vector, tokens of one input) of a model's embeddings; (0, 0): none."""
    e = m.embeddings
    return (e.embedder.dims, e.embedder.context) if e is not None else (0, 0)


def notes_of(req: Request) -> bytes | bytearray:
    """The request's annotation stream (empty unless it asked logprobs)."""
    return req.notes.data if req.notes is not None else b""
