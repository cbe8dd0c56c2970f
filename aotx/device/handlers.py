"""The device's operations: one handler per broker operation, dispatched by
:data:`Handlers.table`.

A handler returns the reply (header and payload), or :class:`Park` for a WAIT that
is not ready yet, or a :class:`~aotx.device.admission.MediaJob` for a submission whose
media the media worker prepares; it refuses by raising
:class:`~aotx.device.errors.DeviceError`.  Every handler runs on the control thread
with the device lock held, and none waits for a decode step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from .. import ids, wire
from ..engine.request import Request
from ..wire import Action, Header, MemoryOp, Op, Reason
from . import residency
from .admission import Admission, MediaJob
from .embeddings import EmbedCall, EmbedCalls, embed
from .errors import DeviceError
from .state import DeviceState, notes_of

log = logging.getLogger("aotx.device")

Reply = tuple[Header, bytes]


@dataclass
class Park:
    """A WAIT to answer when its request changes, or at ``deadline``."""

    request: Request
    deadline: float


Result = Reply | Park | MediaJob | EmbedCall


class Handlers:
    def __init__(self, state: DeviceState, admission: Admission, mailboxes: int,
                 wake: Callable[[], None], cancelled: Callable[[bytes], None]) -> None:
        self.state = state
        self.admission = admission
        self.mailboxes = mailboxes
        self.wake = wake  # rings the device's own doorbell (the policy has work)
        self.cancelled = cancelled  # answers the WAITs parked on a cancelled request
        self.parked_waits = 0  # kept by the runtime, reported in METRICS
        self.embeds: EmbedCalls = {}  # EMBED calls being computed (kept by the runtime)
        self.table: dict[int, Callable[[int, Header, bytes], Result]] = {
            Op.INFO: lambda _m, h, _p: self.ok(h, wire.encode_info(state.info(mailboxes))),
            Op.SUBMIT: lambda m, h, p: admission.submit(h, p, m),
            Op.READ: lambda _m, h, _p: self.read(h),
            Op.WAIT: lambda _m, h, _p: self.read(h),
            Op.CANCEL: lambda _m, h, _p: self.cancel(h),
            Op.UNPARK: lambda _m, h, _p: self.unpark(h),
            Op.GRANT_INSTALL: lambda _m, h, p: self.grant_install(h, p),
            Op.GRANT_READ: lambda _m, h, _p: self.grant_read(h),
            Op.MEDIA_PUT: lambda _m, h, p: self.media_put(h, p),
            Op.MEDIA_LIST: lambda _m, h, _p: self.media_list(h),
            Op.MEDIA_READ: lambda _m, h, _p: self.media_read(h),
            Op.MEDIA_DELETE: lambda _m, h, _p: self.media_delete(h),
            Op.POLICY: lambda _m, h, p: self.policy(h, p),
            Op.MEMORY: lambda _m, h, _p: self.memory(h),
            Op.TELEMETRY: lambda _m, h, _p: self.telemetry(h),
            Op.METRICS: lambda _m, h, _p: self.metrics(h),
            Op.EMBED: lambda m, h, p: embed(state, admission, self.embeds, mailboxes, m, h, p),
            Op.MODELS: lambda _m, h, p: self.models(h, p),
        }

    def handle(self, mailbox: int, h: Header, payload: bytes) -> Result:
        handler = self.table.get(h.op)  # an int finds its Op's entry
        if handler is None:  # the seed's shared operations (10, 11), BROKER_STATS
            raise DeviceError(501, Reason.NOT_SUPPORTED)
        wire.check_request(h)  # the seed: unused input fields are zero
        return handler(mailbox, h, payload)

    def check_epoch(self, h: Header) -> None:
        """The seed: a mutation's frame epoch must be the device's."""
        if h.epoch != self.state.epoch:
            if ids.ended(h.epoch, self.state.epoch):
                raise DeviceError(410, Reason.EPOCH_ENDED)
            raise DeviceError(400, Reason.EPOCH_MISMATCH)

    def ok(self, h: Header, payload: bytes = b"", **fields: object) -> Reply:
        return h.reply(200, epoch=self.state.epoch, **fields), payload

    # -- requests ------------------------------------------------------------------------
    def read(self, h: Header, limit: int = 0) -> Reply | Park:
        """A READ's reply, or a WAIT's when its request has something new (else a Park);
        the window at most ``limit`` bytes (0: the device's window size)."""
        req = self.state.lookup(h, Action.READ)
        if h.op == Op.WAIT and not wait_ready(req, h):
            timeout = wire.wait_timeout_ms(h) / 1000
            return Park(req, time.monotonic() + timeout)
        return self.read_reply(req, h, limit)

    def read_reply(self, req: Request, h: Header, limit: int = 0) -> Reply:
        notes = bool(h.flags & wire.READ_FLAG_ANNOTATIONS)
        body = self.state.window(req, h.cursor, notes, limit)
        return h.reply(200, epoch=self.state.epoch, **self.state.state_fields(req, notes)), body

    def cancel(self, h: Header) -> Reply:
        st = self.state
        req = self._admin_lookup(h) if h.cancel_flags & wire.CANCEL_FLAG_ADMIN else st.lookup(
            h, Action.CANCEL)
        if not req.phase.terminal:
            st.cancel(req)
            log.debug("event=request.cancel id=%s", st.request_id(req.identity))
            self.cancelled(req.identity)
        return h.reply(202, epoch=st.epoch, **st.state_fields(req)), b""

    def _admin_lookup(self, h: Header) -> Request:
        """Any principal's request, for a caller whose grant has the admin action."""
        st = self.state
        st.grant_for(h, Action.ADMIN)
        req = st.requests.get(h.identity) if h.epoch == st.epoch else None
        if req is None:
            if ids.ended(h.epoch, st.epoch):
                raise DeviceError(410, Reason.EPOCH_ENDED)
            raise DeviceError(404, Reason.NO_REQUEST)
        log.info("event=request.admin_cancel id=%s principal=%d by=%d",
                 st.request_id(req.identity), req.principal, h.principal)
        return req

    def unpark(self, h: Header) -> Reply:
        """The caller left: answer its parked WAITs on the request now, or withdraw its
        EMBED call of that identity, so that their mailboxes are free at once (not at
        the WAITs' timeouts, or once the call's inputs are embedded)."""
        call = self.embeds.get((h.principal, h.identity))
        if call is not None and call.job is not None:
            call.queue.withdraw(call.job)  # answered now: its mailbox is free
            return self.ok(h)
        req = self.state.lookup(h, Action.READ)
        self.cancelled(req.identity)
        return self.ok(h)

    # -- grants: only same-uid processes reach the mailboxes (the broker checks
    # SO_PEERCRED), so grant installation is trusted to the gateway.
    def grant_install(self, h: Header, payload: bytes) -> Reply:
        st = self.state
        installed, stopped = [], 0
        for g in wire.decode_grants(payload, h.row_count):
            st.grant_revision += 1  # revisions only increase
            ng = g._replace(revision=st.grant_revision)
            st.grants[g.principal] = ng
            installed.append(ng)
            # The principal's requests were admitted under an earlier revision: nobody can
            # read them any more (a revoked token, a replaced grant), so they stop now.
            for r in st.cancel_all(g.principal, keep_revision=ng.revision):
                self.cancelled(r.identity)
                stopped += 1
        log.info("event=grant.install rows=%d revision=%d cancelled=%d", len(installed),
                 st.grant_revision, stopped)
        return self.ok(h, wire.encode_grants(installed), total=len(installed))

    def grant_read(self, h: Header) -> Reply:
        """One page: the rows of principals >= ``first_principal``, in principal order."""
        rows = sorted((g for g in self.state.grants.values()
                       if g.principal >= h.first_principal),
                      key=lambda g: g.principal)[:wire.GRANT_PAGE]
        return self.ok(h, wire.encode_grants(rows), total=len(rows))

    # -- media sources -------------------------------------------------------------------
    def media_put(self, h: Header, payload: bytes) -> Reply:
        grant = self.state.grant_for(h, Action.MEDIA)
        flags = h.media_flags
        status, src = self.state.media.put(
            h.principal, h.upload_id, h.cursor, h.content_type, payload,
            bool(flags & wire.MEDIA_FLAG_FINAL), bool(flags & wire.MEDIA_FLAG_ABORT), grant,
            ephemeral=bool(flags & wire.MEDIA_FLAG_EPHEMERAL))
        if src is None:
            return h.reply(status, epoch=self.state.epoch), b""
        if status == 201:
            log.debug("event=media.%s source=src-%s bytes=%d", src.state.name.lower(),
                      src.id.hex(), src.size)
        return (h.reply(status, epoch=self.state.epoch, identity=src.id, role=src.content_type,
                        reason=int(src.reason)), wire.encode_media_meta(src.meta()))

    def media_list(self, h: Header) -> Reply:
        self.state.grant_for(h, Action.MEDIA)
        limit = min(h.max_rows or 100, wire.MEDIA_LIST_MAX_ROWS)
        page, nxt = self.state.media.page(h.principal, h.cursor, limit)
        return self.ok(h, wire.encode_media_rows([(s.id, s.meta()) for s in page]),
                       total=len(page), cursor=nxt)

    def media_read(self, h: Header) -> Reply:
        self.state.grant_for(h, Action.MEDIA)
        src = self.state.media.get(h.principal, h.source_id)
        return self.ok(h, wire.encode_media_meta(src.meta()), role=src.content_type,
                       reason=int(src.reason))

    def media_delete(self, h: Header) -> Reply:
        self.state.grant_for(h, Action.MEDIA)
        self.state.media.remove(h.principal, h.source_id)
        log.debug("event=media.removed source=src-%s", h.source_id.hex())
        return self.ok(h)

    # -- the resident policy and a principal's memory ----------------------------------------
    def policy(self, h: Header, payload: bytes) -> Reply:
        st = self.state
        if not payload:  # a read: either action will do (grant_for takes any bit of a mask)
            st.grant_for(h, Action.POLICY_READ | Action.POLICY_CONTROL)
            return self.ok(h, wire.encode_policy_status(st.policy.status()))
        if h.principal not in st.grants:  # before the payload is looked at
            raise DeviceError(403, Reason.NO_GRANT)
        control = wire.decode_policy_control(payload)
        st.grant_for(h, Action.POLICY_CONTROL)
        self.check_epoch(h)
        st.policy.control(control.action, control.expected_revision)
        self.wake()
        return self.ok(h, wire.encode_policy_status(st.policy.status()))

    def memory(self, h: Header) -> Reply:
        st = self.state
        st.grant_for(h, Action.READ)
        policy, op = st.policy, h.memory_op
        if op == MemoryOp.READ:
            gen, facts = policy.lineage(h.principal).latest()
            return self.ok(h, orjson.dumps({"generation": gen, "facts": facts}))
        if op == MemoryOp.ERASE:
            removed = policy.erase(h.principal)
            log.info("event=memory.erased principal=%d generations=%d", h.principal, removed)
            return self.ok(h)
        if op == MemoryOp.PENDING:
            return self.ok(h, orjson.dumps([{"id": str(p.id), "fact": p.fact}
                                            for p in policy.pending_of(h.principal)]))
        if op in (MemoryOp.APPROVE, MemoryOp.REJECT):
            policy.decide_pending(h.principal, h.pending_id, op == MemoryOp.APPROVE)
            return self.ok(h)
        raise DeviceError(400, Reason.MEMORY_OP)

    # -- models loaded on first use (device/residency.py) -----------------------------------
    def models(self, h: Header, payload: bytes) -> Reply:
        st = self.state
        if not payload:  # a read: every model, as INFO lists them
            return self.ok(h, residency.status(st, st.budget, st.unassigned))
        st.grant_for(h, Action.ADMIN)
        alias, action, cancel = residency.parse_control(payload)
        self.check_epoch(h)
        od, cancelled = residency.control(st, alias, action, cancel, h.principal,
                                          time.monotonic())
        for identity in cancelled:
            self.cancelled(identity)
        log.info("event=model.%s_asked alias=%s by=%d cancelled=%d", action, alias,
                 h.principal, len(cancelled))
        self.wake()
        entry = next(e for e in residency.entries(st, time.monotonic())
                     if e["alias"] == od.spec.alias)
        return self.ok(h, orjson.dumps(entry))

    # -- counters --------------------------------------------------------------------------
    def telemetry(self, h: Header) -> Reply:
        self.state.grant_for(h, Action.TELEMETRY)
        return self.ok(h, wire.encode_telemetry(self.state.telemetry()))

    def metrics(self, h: Header) -> Reply:
        self.state.grant_for(h, Action.TELEMETRY)
        return self.ok(h, orjson.dumps({**self.state.metrics(self.parked_waits),
                                        "embed_calls": len(self.embeds)}))


def wait_ready(req: Request, h: Header) -> bool:
    """Does a WAIT that saw ``h`` have something new: bytes (of its annotation stream
    with READ_FLAG_ANNOTATIONS), a phase or a cancel flag?"""
    total = len(notes_of(req)) if h.flags & wire.READ_FLAG_ANNOTATIONS else len(req.out)
    return (total != h.cursor or req.phase != h.phase
            or req.cancel_requested != bool(h.cancel_requested) or req.phase.terminal)
