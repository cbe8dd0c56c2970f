"""The device runtime: the authority for grants, requests, results and models.

Threads
-------
* The **control thread** (the process's main thread) waits on the device
  doorbell, takes each published mailbox, answers it and publishes the reply.
  Admissions, reads, cancellations and telemetry never wait for a decode step.
  ``WAIT`` packets (a subscriber waiting for new bytes) are parked and answered
  as soon as the engine produces bytes or the request changes state.
* One **engine thread** per model runs its :class:`~aotx.scheduler.Scheduler`.
  After each step it rings the device's own doorbell when packets are parked,
  so the control thread answers them without polling.

All request state is guarded by one lock, held briefly by both threads and
never during ``llama_decode``.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import queue
import re
import secrets
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import wire
from ..cpuslice import request_short_slice
from ..engine.llama import EngineConfig, LlamaEngine
from ..engine.multimodal import MARKER, MediaEncoder, MediaInputError, MediaSegment, release_all
from ..engine.sampling import Sampler
from ..engine.scheduler import Request, Scheduler, common_prefix
from ..mailbox import REQUEST, SCAN_ALL, WAKE, Bell, Region
from ..paths import RuntimePaths
from ..wire import Action, Header, Op, Phase, PolicyReason, PolicyState, WireError
from .media import MediaError, MediaTable
from .models import ModelSpec, file_sha256, load_specs
from .policy import (
    EXTRACTION_MAX_TOKENS,
    EXTRACTION_PROMPT,
    MAX_SOURCE_CHARS,
    PolicyCore,
    decide,
    inject,
    qualified,
)
from .policy import Pending as PolicyPending
from .policy import Source as PolicySource
from .template import ChatTemplate, TemplateError

log = logging.getLogger("aotx.device")

WAIT_DEFAULT_MS = 15_000
WAIT_MAX_MS = 60_000


@dataclass
class DeviceLimits:
    window_bytes: int = 32768
    max_active: int = 1024  # queued + running, device-wide
    retention_seconds: int = 900
    retention_requests: int = 4096
    max_output_tokens: int = 8192
    media_bytes: int = 64 << 20  # largest single source
    media_total_bytes: int = 1 << 30  # all sources of the activation together


@dataclass
class LoadedModel:
    spec: ModelSpec
    engine: LlamaEngine
    template: ChatTemplate
    scheduler: Scheduler
    sha256: bytes
    published_at: int
    thread: threading.Thread | None = None
    modalities: int = wire.MOD_TEXT
    media_marker: str = MARKER  # where a media part sits in the rendered prompt
    encoder: MediaEncoder | None = None  # the projector, for image/audio input
    automatic_memory: bool = False  # the exact file, template and processors are qualified


@dataclass
class Parked:
    mailbox: int
    header: Header
    deadline: float


@dataclass
class Counters:
    admitted: int = 0
    refused: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))


def next_epoch(paths: RuntimePaths) -> int:
    """Hand out the next runtime epoch for this state folder, durably, never twice."""
    last = 0
    try:
        with open(paths.epoch_file) as f:
            last = int(f.read().strip() or 0)
    except FileNotFoundError:
        pass
    except ValueError:
        raise SystemExit(f"{paths.epoch_file} is corrupt; refusing to guess an epoch") from None
    epoch = last + 1
    tmp = paths.epoch_file + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{epoch}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, paths.epoch_file)
    dfd = os.open(paths.state_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return epoch


def _role_name(role: wire.Role) -> str:
    return ("system", "user", "assistant")[role]


class Device:
    def __init__(self, paths: RuntimePaths, specs: list[ModelSpec], mailboxes: int,
                 limits: DeviceLimits | None = None) -> None:
        self.paths = paths
        self.limits = limits or DeviceLimits()
        paths.ensure()
        self._lockfile = os.open(os.path.join(paths.run_dir, "device.lock"),
                                 os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another device is running on {paths.state_dir}") from None
        self.epoch = next_epoch(paths)
        self.started_unix_ns = time.time_ns()
        self.clock0 = time.monotonic_ns()
        self.lock = threading.Lock()
        self.requests: collections.OrderedDict[bytes, Request] = collections.OrderedDict()
        self.terminal_order: collections.deque[bytes] = collections.deque()
        self.grants: dict[int, wire.Grant] = {}
        self.grant_revision = 0
        self.admissions: dict[int, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        self.parked: dict[bytes, list[Parked]] = collections.defaultdict(list)
        self.parked_mailboxes: set[int] = set()
        self.busy_mailboxes: set[int] = set()  # submissions whose media is being prepared
        self._media_jobs: queue.Queue[Any] | None = None  # the media worker's queue
        self._media_thread: threading.Thread | None = None
        self.n_parked = 0
        self.counters = Counters()
        self.models: dict[int, LoadedModel] = {}
        self.media = MediaTable(self.limits.media_bytes, self.limits.media_total_bytes)
        self.leases: dict[bytes, list[bytes]] = {}  # request identity -> leased source ids
        self.region = Region(paths.region, mailboxes)
        self.bell = Bell(paths.device_bell, paths.broker_bell)
        self._stopping = False
        for spec in specs:
            self._load(spec)
        self.policy = PolicyCore(os.path.join(paths.state_dir, "memory"),
                                 enabled=any(m.automatic_memory for m in self.models.values()))
        self.memory_cache: dict[int, tuple[int, list[str]]] = {}
        self.log_prompts = os.environ.get("AOTX_LOG_PROMPTS") == "1"

    # -- models ----------------------------------------------------------------
    def _load(self, spec: ModelSpec) -> None:
        log.info("event=model.load alias=%s role=%d path=%s slots=%d context=%d",
                 spec.alias, spec.role, spec.path, spec.slots, spec.context)
        t0 = time.monotonic()
        digest = file_sha256(spec.path, os.path.join(self.paths.state_dir, "model-hashes.json"))
        if spec.sha256 and digest.hex() != spec.sha256:
            raise SystemExit(f"model {spec.alias}: {spec.path} has SHA-256 {digest.hex()}, "
                             f"the models file pins {spec.sha256}")
        batch = max(spec.batch, spec.slots)  # every running sequence fits one step
        engine = LlamaEngine(EngineConfig(path=spec.path, slots=spec.slots,
                                          slot_context=spec.context, batch=batch,
                                          threads=spec.threads, poll=spec.poll))
        try:
            template = ChatTemplate(engine.metadata("tokenizer.chat_template"),
                                    bos_token=engine.token_text(
                                        int(engine.metadata("tokenizer.ggml.bos_token_id") or 0)),
                                    eos_token=engine.token_text(
                                        int(engine.metadata("tokenizer.ggml.eos_token_id") or 0)))
        except TemplateError as exc:
            engine.close()
            raise SystemExit(f"model {spec.alias} ({spec.path}) refused: {exc}") from None
        encoder = None
        mods = 0
        for m in spec.modalities:
            mods |= wire.MODALITY_BITS[m]
        if spec.mmproj:
            try:
                encoder = MediaEncoder(spec.mmproj, engine.model, engine.n_embd, engine.threads,
                                       batch)
            except MediaInputError as exc:
                engine.close()
                raise SystemExit(f"model {spec.alias}: {exc}") from None
            found = (wire.MOD_TEXT | (wire.MOD_IMAGE if encoder.vision else 0)
                     | (wire.MOD_AUDIO if encoder.audio else 0))
            if spec.modalities and mods != found:
                encoder.close()
                engine.close()
                raise SystemExit(f"model {spec.alias}: the models file declares modalities "
                                 f"{list(spec.modalities)}, but {spec.mmproj} encodes "
                                 f"{wire.modality_names(found)}")
            mods = found
            log.info("event=model.projector alias=%s path=%s modalities=%s", spec.alias,
                     spec.mmproj, ",".join(wire.modality_names(mods)))
        scheduler = Scheduler(
            engine, spec.slots, batch, self.lock,
            make_sampler=lambda r: Sampler(r.temperature, r.top_p, r.seed),
            free_sampler=lambda s: s.free(),  # type: ignore[attr-defined]
            on_step=self._after_step, on_terminal=self._on_terminal,
            encode=encoder.encode if encoder is not None else None)
        warm = self._template_prefix(engine, template)
        scheduler.warm(warm)
        self.models[spec.role] = LoadedModel(spec, engine, template, scheduler, digest,
                                             int(os.stat(spec.path).st_mtime), modalities=mods,
                                             automatic_memory=qualified(digest, template.source),
                                             encoder=encoder)
        log.info("event=model.ready alias=%s role=%d sha256=%s params_bytes=%d kv_bytes=%d "
                 "threads=%d seconds=%.1f", spec.alias, spec.role, digest.hex(),
                 engine.model_bytes, engine.kv_bytes(), engine.threads, time.monotonic() - t0)

    @staticmethod
    def _template_prefix(engine: LlamaEngine, template: ChatTemplate) -> list[int]:
        """The tokens every one-user-message chat starts with (for SmolLM2: its
        default system prompt and the user's header), found by rendering two
        different conversations and keeping what their tokens have in common."""
        try:
            a, b = (engine.tokenize(template.render([{"role": "user", "content": c}]),
                                    add_special=engine.add_bos) for c in ("Hi.", "What?"))
        except TemplateError:
            return []
        n = common_prefix(a, b)
        return a[:n] if n >= 8 else []

    # -- engine callbacks (engine thread, lock held for on_terminal) ------------
    def _on_terminal(self, req: Request) -> None:
        if req.background:
            self.bell.ring_self()  # the control thread collects the policy's result
            return
        self.terminal_order.append(req.identity)
        if req.source_text and req.phase is Phase.COMPLETED:
            # The user's own words are the source: facts about the user come from what
            # the user said (the answer is not fed back, so the model cannot quote itself).
            self.policy.log.append(PolicySource(req.principal, req.role, req.source_text))
            self.bell.ring_self()
        for sid in self.leases.pop(req.identity, []):
            self.media.unlease(sid)

    def _after_step(self) -> None:
        if self.n_parked:
            self.bell.ring_self()

    # -- helpers -----------------------------------------------------------------
    def info(self) -> wire.Info:
        first = next(iter(self.models.values()))
        return wire.Info(
            epoch=self.epoch,
            models=tuple(wire.ModelInfo(m.spec.role, m.spec.alias, m.sha256, m.modalities,
                                        m.published_at, m.engine.slot_context,
                                        m.automatic_memory)
                         for m in self.models.values()),
            window_bytes=self.limits.window_bytes,
            context_tokens=first.engine.slot_context,
            output_tokens=self.limits.max_output_tokens,
            active_requests=self.limits.max_active,
            slots=sum(m.spec.slots for m in self.models.values()),
            media_bytes=self.limits.media_bytes,
            retention_seconds=self.limits.retention_seconds,
            retention_requests=self.limits.retention_requests,
            mailboxes=self.region.count,
            kv_cells=sum(m.spec.slots * m.engine.slot_context for m in self.models.values()),
            started_unix_ns=self.started_unix_ns)

    def _state_fields(self, req: Request) -> dict[str, int]:
        return dict(phase=int(req.phase), role=req.role, total=len(req.out),
                    prompt_tokens=req.prompt_tokens, sampled_tokens=req.sampled,
                    finish=int(req.finish), failure=req.failure,
                    cancel_requested=int(req.cancel_requested), revision=req.revision)

    def _grant_for(self, h: Header, action: int) -> tuple[wire.Grant | None, int, str]:
        grant = self.grants.get(h.principal)
        if grant is None:
            return None, 403, "no grant is installed for this principal"
        if not grant.actions & action:
            return None, 403, f"the grant does not include the {Action(action).name.lower()} action"
        return grant, 0, ""

    def _submit_grant(self, h: Header) -> tuple[wire.Grant | None, int, str]:
        """The caller's grant if it may submit to the model named by ``h.role``."""
        grant, status, msg = self._grant_for(h, Action.SUBMIT)
        if grant is not None and (h.role not in self.models
                                  or not (grant.model_mask >> h.role) & 1):
            return None, 404, "no such model"
        return grant, status, msg

    def _lookup(self, h: Header, action: int) -> tuple[Request | None, int, str]:
        """The request named by ``h`` if the caller may act on it, else (None, status, message).

        Order matters: an ended epoch is 410 for everyone; a missing action is
        403 without looking at the handle; anything that would reveal a foreign
        or revoked request is 404.
        """
        if h.epoch != self.epoch:
            if 0 < h.epoch < self.epoch:
                return None, 410, "the request belongs to an ended runtime epoch"
            return None, 404, "no such request"
        _grant, status, msg = self._grant_for(h, action)
        if _grant is None:
            return None, status, msg
        req = self.requests.get(h.identity)
        if (req is None or req.principal != h.principal or req.revision != _grant.revision
                or not (_grant.model_mask >> req.role) & 1):
            return None, 404, "no such request"
        return req, 0, ""

    def _window(self, req: Request, cursor: int) -> tuple[int, bytes]:
        total = len(req.out)
        if cursor > total:
            return 409, f"cursor {cursor} is past the {total} bytes produced so far".encode()
        return 200, bytes(req.out[cursor:cursor + self.limits.window_bytes])

    # -- operations (control thread, lock held) -----------------------------------
    def handle(self, mailbox: int, h: Header, payload: bytes) -> tuple[Header, bytes] | None:
        op = Op(h.op)
        if op is Op.INFO:
            return h.reply(200, epoch=self.epoch), wire.encode_info(self.info())
        if op is Op.GRANT_INSTALL:
            return self._grant_install(h, payload)
        if op is Op.GRANT_READ:
            # One page: the rows of principals >= cursor, in principal order.
            rows = sorted((g for g in self.grants.values() if g.principal >= h.cursor),
                          key=lambda g: g.principal)[:wire.GRANT_PAGE]
            return h.reply(200, epoch=self.epoch, total=len(rows)), wire.encode_grants(rows)
        if op is Op.SUBMIT:
            return self._submit(h, payload, mailbox)
        if op in (Op.READ, Op.WAIT):
            return self._read(mailbox, h)
        if op is Op.CANCEL:
            return self._cancel(h)
        if op in (Op.MEDIA_PUT, Op.MEDIA_LIST, Op.MEDIA_READ, Op.MEDIA_DELETE):
            grant, status, msg = self._grant_for(h, Action.MEDIA)
            if grant is None:
                return h.reply(status, epoch=self.epoch), msg.encode()
            try:
                return self._media(op, h, payload, grant)
            except MediaError as exc:
                return h.reply(exc.status, epoch=self.epoch), exc.message.encode()
        if op is Op.POLICY:
            return self._policy_op(h, payload)
        if op is Op.MEMORY:
            return self._memory_op(h)
        if op is Op.METRICS:
            grant, status, msg = self._grant_for(h, Action.TELEMETRY)
            if grant is None:
                return h.reply(status, epoch=self.epoch), msg.encode()
            return h.reply(200, epoch=self.epoch), orjson.dumps(self.metrics())
        if op is Op.TELEMETRY:
            grant, status, msg = self._grant_for(h, Action.TELEMETRY)
            if grant is None:
                return h.reply(status, epoch=self.epoch), msg.encode()
            return h.reply(200, epoch=self.epoch), wire.encode_telemetry(self.telemetry())
        return (h.reply(501, epoch=self.epoch),
                f"operation {op.name} is not provided by this device".encode())

    def _media(self, op: Op, h: Header, payload: bytes,
               grant: wire.Grant) -> tuple[Header, bytes]:
        if op is Op.MEDIA_PUT:
            status, src = self.media.put(h.principal, h.identity, h.cursor, h.role, payload,
                                         bool(h.submit_flags & wire.MEDIA_FLAG_FINAL),
                                         bool(h.submit_flags & wire.MEDIA_FLAG_ABORT), grant,
                                         ephemeral=bool(h.submit_flags & wire.MEDIA_FLAG_EPHEMERAL))
            if src is None:
                return h.reply(status, epoch=self.epoch), b""
            if status == 201:
                log.info("event=media.%s source=src-%s bytes=%d", src.state.name.lower(),
                         src.id.hex(), src.size)
            return (h.reply(status, epoch=self.epoch, identity=src.id),
                    wire.encode_media_meta(src.meta()) + src.reason.encode())
        if op is Op.MEDIA_LIST:
            limit = min(h.max_tokens or 100, wire.MEDIA_LIST_MAX_ROWS)
            page, nxt = self.media.page(h.principal, h.cursor, limit)
            reply = h.reply(200, epoch=self.epoch, total=len(page))
            reply.cursor = nxt
            return reply, wire.encode_media_rows([(s.id, s.meta()) for s in page])
        if op is Op.MEDIA_READ:
            src = self.media.get(h.principal, h.identity)
            return h.reply(200, epoch=self.epoch), wire.encode_media_meta(src.meta()) + src.reason.encode()
        self.media.remove(h.principal, h.identity)
        log.info("event=media.removed source=src-%s", h.identity.hex())
        return h.reply(200, epoch=self.epoch), b""

    # -- resident policy (control thread, lock held) -----------------------------
    def _policy_op(self, h: Header, payload: bytes) -> tuple[Header, bytes]:
        grant = self.grants.get(h.principal)
        actions = grant.actions if grant else 0
        if not payload:
            if not actions & (Action.POLICY_READ | Action.POLICY_CONTROL):
                return h.reply(403, epoch=self.epoch), b"policy read needs action bit 8 or 128"
            return h.reply(200, epoch=self.epoch), wire.encode_policy_status(self.policy.status())
        control = wire.decode_policy_control(payload)
        if not actions & Action.POLICY_CONTROL:
            return h.reply(403, epoch=self.epoch), b"policy control needs action bit 128"
        if h.epoch != self.epoch:
            status = 410 if 0 < h.epoch < self.epoch else 400
            return h.reply(status, epoch=self.epoch), b"the frame epoch does not match"
        if h.identity != bytes(16) or h.cursor:
            return h.reply(400, epoch=self.epoch), b"request id and cursor must be zero"
        status = self.policy.control(control.action, control.expected_revision)
        log.info("event=policy.control action=%s status=%d revision=%d", control.action.name,
                 status, self.policy.control_revision)
        self.bell.ring_self()
        return (h.reply(status, epoch=self.epoch),
                wire.encode_policy_status(self.policy.status()))

    def _memory_op(self, h: Header) -> tuple[Header, bytes]:
        grant, status, msg = self._grant_for(h, Action.READ)
        if grant is None:
            return h.reply(status, epoch=self.epoch), msg.encode()
        sub = wire.MemoryOp(h.role) if h.role in wire.MemoryOp._value2member_map_ else None
        core = self.policy
        if sub is wire.MemoryOp.READ:
            gen, facts = core.lineage(h.principal).latest()
            return h.reply(200, epoch=self.epoch), orjson.dumps(
                {"generation": gen, "facts": facts})
        if sub is wire.MemoryOp.ERASE:
            removed = core.lineage(h.principal).erase()
            core.forget(h.principal)
            self.memory_cache.pop(h.principal, None)
            log.info("event=memory.erased principal=%d generations=%d", h.principal, removed)
            return h.reply(200, epoch=self.epoch), b""
        if sub is wire.MemoryOp.PENDING:
            mine = [{"id": str(p.id), "fact": p.fact} for p in core.pending
                    if p.principal == h.principal]
            return h.reply(200, epoch=self.epoch), orjson.dumps(mine)
        if sub in (wire.MemoryOp.APPROVE, wire.MemoryOp.REJECT):
            p = next((p for p in core.pending if p.id == h.cursor and p.principal == h.principal),
                     None)
            if p is None:
                return h.reply(404, epoch=self.epoch), b"no such pending decision"
            core.pending.remove(p)
            core.decisions += 1
            if sub is wire.MemoryOp.APPROVE:
                core.save(p.principal, [p.fact])
                self.memory_cache.pop(p.principal, None)
            if not core.pending and core.state is PolicyState.RECORDING:
                core.state = PolicyState.QUIET
            return h.reply(200, epoch=self.epoch), b""
        return h.reply(400, epoch=self.epoch), b"unknown memory operation"

    def _memory_for(self, principal: int) -> list[str]:
        cached = self.memory_cache.get(principal)
        if cached is None:
            cached = self.policy.lineage(principal).latest()
            self.memory_cache[principal] = cached
        return cached[1]

    def _policy_tick(self) -> None:
        core = self.policy
        if not core.enabled:
            return
        req = core.active
        if isinstance(req, Request) and req.phase.terminal:
            self._policy_collect(req)
        if core.active is not None or core.state in (PolicyState.PAUSED, PolicyState.STOPPED):
            return
        if core.frontier >= len(core.log):
            core.state = PolicyState.RECORDING if core.pending else PolicyState.QUIET
            if core.reason is not PolicyReason.CAPACITY:
                core.reason = PolicyReason.QUIET
            return
        if any(not r.background for m in self.models.values()
               for r in (*m.scheduler.queue, *m.scheduler.active)):
            core.state, core.reason = PolicyState.QUIET, PolicyReason.FOREGROUND
            return
        source = core.log[core.frontier]
        model = self.models[source.role]
        messages = [{"role": "system", "content": EXTRACTION_PROMPT},
                    {"role": "user", "content": source.text[-MAX_SOURCE_CHARS:]}]
        prompt = model.engine.tokenize(model.template.render(messages),
                                       add_special=model.engine.add_bos)
        prompt = prompt[-(model.engine.slot_context - EXTRACTION_MAX_TOKENS - 1):]
        work = Request(identity=secrets.token_bytes(16), principal=0, revision=0,
                       role=source.role, prompt=prompt, max_tokens=EXTRACTION_MAX_TOKENS,
                       background=True)
        core.active = work
        core.active_started = time.monotonic_ns()
        core.state, core.reason = PolicyState.ACTIVE, PolicyReason.ACTIVE
        model.scheduler.submit(work)

    def _policy_collect(self, req: Request) -> None:
        core = self.policy
        core.active = None
        elapsed = time.monotonic_ns() - core.active_started
        core.last_ns = elapsed
        core.max_ns = max(core.max_ns, elapsed)
        held = core.state in (PolicyState.PAUSED, PolicyState.STOPPED)  # a control came first
        if core.discard_active:  # its principal erased its memory meanwhile
            core.discard_active = False
            core.log[core.frontier].text = ""
            core.frontier += 1
            if not held:
                core.state = PolicyState.RECORDING if core.pending else PolicyState.QUIET
            log.info("event=policy.source_dropped frontier=%d", core.frontier)
            return
        if req.preempted or req.phase is not Phase.COMPLETED:
            core.interrupted += 1
            if not held:
                core.state, core.reason = PolicyState.QUIET, PolicyReason.FOREGROUND
            log.info("event=policy.interrupted frontier=%d", core.frontier)
            return  # the same source is retried when the device is quiet again
        source = core.log[core.frontier]
        answer = bytes(req.out).decode("utf-8", errors="replace")
        core.result_bytes += len(req.out)
        existing = self._memory_for(source.principal)
        kept = []
        for line in re.split(r"\n|(?<=[.!?])\s+(?=[A-Z-])", answer):
            if not line.strip():
                continue
            fact = decide(line, existing + kept, source.text)
            core.decisions += 1
            if fact is not None:
                kept.append(fact)
        if kept and core.review:
            for fact in kept:
                core.pending.append(PolicyPending(core.next_pending, source.principal, fact))
                core.next_pending += 1
        elif kept:
            core.save(source.principal, kept)
            self.memory_cache.pop(source.principal, None)
        source.text = ""  # processed: the text is not needed any more
        core.frontier += 1
        core.completed += 1
        if not held:
            core.state = PolicyState.RECORDING if core.pending else PolicyState.QUIET
            if core.reason is not PolicyReason.CAPACITY:
                core.reason = PolicyReason.QUIET
        log.info("event=policy.source_done frontier=%d kept=%d pending=%d", core.frontier,
                 len(kept), len(core.pending))

    def metrics(self) -> dict[str, object]:
        by_phase: collections.Counter[str] = collections.Counter(
            r.phase.name.lower() for r in self.requests.values())
        models = {}
        for m in self.models.values():
            sc = m.scheduler
            models[m.spec.alias] = {
                "queue_depth": len(sc.queue), "active_slots": len(sc.active),
                "slots": m.spec.slots, "steps": sc.tick, "prompt_tokens": sc.prompt_tokens_in,
                "completion_tokens": sc.tokens_out, "finished": dict(sc.finished),
                "ttft_seconds": sc.ttft.snapshot(), "inter_token_seconds": sc.itl.snapshot()}
        return {"epoch": self.epoch, "requests_by_state": dict(by_phase),
                "admitted": self.counters.admitted,
                "refused": {str(k): v for k, v in self.counters.refused.items()},
                "models": models, "parked_waits": self.n_parked,
                "media_bytes": self.media.total_bytes,
                "allocation_bytes": self.telemetry().allocation_bytes}

    def telemetry(self) -> wire.Telemetry:
        alloc = 0
        for m in self.models.values():
            alloc += m.engine.model_bytes + m.engine.kv_bytes()
        alloc += sum(len(r.out) + 4 * len(r.prompt) for r in self.requests.values())
        alloc += self.media.total_bytes
        tick = sum(m.scheduler.tick for m in self.models.values())
        return wire.Telemetry(alloc, tick, time.monotonic_ns() - self.clock0)

    def _grant_install(self, h: Header, payload: bytes) -> tuple[Header, bytes]:
        # Only same-uid processes reach the mailboxes (the broker checks SO_PEERCRED),
        # so grant installation is trusted to the gateway.  Revisions only increase.
        rows = wire.decode_grants(payload, h.total)
        installed = []
        for g in rows:
            self.grant_revision += 1
            ng = wire.Grant(g.principal, g.actions, g.model_mask, self.grant_revision, g.flags,
                            g.max_active, g.max_output_tokens, g.max_input_bytes,
                            g.max_media_sources, g.max_media_bytes, g.rate_per_minute)
            self.grants[g.principal] = ng
            installed.append(ng)
        log.info("event=grant.install rows=%d revision=%d", len(rows), self.grant_revision)
        return h.reply(200, epoch=self.epoch, total=len(installed)), wire.encode_grants(installed)

    def _submit(self, h: Header, payload: bytes, mailbox: int = -1) -> tuple[Header, bytes] | None:
        def refuse(status: int, msg: str, retry_after: int = 0) -> tuple[Header, bytes]:
            # A 429 carries its Retry-After seconds at offset 104.
            self.counters.refused[status] += 1
            return h.reply(status, epoch=self.epoch, max_tokens=retry_after), msg.encode()

        grant, status, msg = self._submit_grant(h)
        if grant is None:
            return refuse(status, msg)
        model = self.models[h.role]
        if grant.max_input_bytes and len(payload) > grant.max_input_bytes:
            return refuse(413, f"input of {len(payload)} bytes exceeds the grant's "
                               f"{grant.max_input_bytes}")
        sub = wire.decode_submission(payload)
        messages = []
        leased = []
        for msg_ in sub.messages:
            text = []
            for part in msg_.parts:
                if part.kind is not wire.PartKind.TEXT:
                    kind = "image" if part.kind is wire.PartKind.IMAGE_DIGEST else "audio"
                    if not model.modalities & (wire.MOD_IMAGE if kind == "image" else wire.MOD_AUDIO):
                        return refuse(400, f"model {model.spec.alias} does not accept {kind} input")
                    src = self.media.ready_by_digest(h.principal, part.data)
                    if src is None or src.kind is not part.kind:
                        return refuse(404, f"no ready {kind} source with digest "
                                           f"sha256:{part.data.hex()}")
                    leased.append(src)
                    text.append(model.media_marker)
                    continue
                text.append(part.text)
            messages.append({"role": _role_name(msg_.role), "content": "".join(text)})
        memory_on = (model.automatic_memory and grant.flags & wire.GRANT_FLAG_MEMORY
                     and not h.submit_flags & wire.SUBMIT_FLAG_MEMORY_OFF and not leased)
        if memory_on:
            messages = inject(messages, self._memory_for(h.principal))
        try:
            prompt_text = model.template.render(messages)
        except TemplateError as exc:
            return refuse(400, str(exc))
        if not leased:
            prompt = model.engine.tokenize(prompt_text, add_special=model.engine.add_bos)
            return self._admit(h, grant, model, sub, prompt, prompt_text, [], [], messages,
                               bool(memory_on), refuse)
        if model.encoder is None:
            return refuse(400, f"model {model.spec.alias} has no multimodal projector")
        # Decoding and preprocessing media takes time (a large image: a good part of a
        # second): the media worker does it without the lock, and this mailbox is
        # answered when it is done.  The sources are leased from now on, so they
        # cannot be removed meanwhile; a refusal gives the leases back.
        for src in leased:
            self.media.lease(src)
        job = (h, model, sub, prompt_text, leased, messages, bool(memory_on), refuse)
        if self._media_jobs is None:  # no worker (unit tests drive handle() directly)
            return self._prepare_media(*job, locked=True)
        self.busy_mailboxes.add(mailbox)
        self._media_jobs.put((mailbox, job))
        return None

    def _media_worker(self) -> None:
        assert self._media_jobs is not None
        while (item := self._media_jobs.get()) is not None:
            mailbox, job = item
            try:
                reply = self._prepare_media(*job, locked=False)
            except Exception:  # never leave the mailbox unanswered or the worker dead
                log.exception("event=media.error")
                reply = job[0].reply(500, epoch=self.epoch), b"internal device error"
            with self.lock:
                self.busy_mailboxes.discard(mailbox)
                self._publish(mailbox, *reply)

    def _prepare_media(self, h: Header, model: LoadedModel, sub: wire.Submission, prompt_text: str, leased: list[Any],
                       messages: list[dict[str, str]], memory_on: bool,
                       refuse: Callable[..., tuple[Header, bytes]],
                       locked: bool) -> tuple[Header, bytes]:
        """Tokenize a media request (lock not held unless ``locked``) and admit it."""
        assert model.encoder is not None
        segments: list[MediaSegment] = []
        prompt: list[int] = []
        error = ""
        try:
            prompt, segments = model.encoder.tokenize(
                prompt_text, [("image" if s.kind is wire.PartKind.IMAGE_DIGEST else "audio",
                               s.data) for s in leased], add_special=model.engine.add_bos)
            if not prompt or prompt[-1] < 0:
                error = "a prompt must end with text after its last media part"
        except MediaInputError as exc:
            error = str(exc)
        except Exception:
            log.exception("event=media.error")
            error = "the media could not be prepared"
        with contextlib.nullcontext() if locked else self.lock:
            reply = None
            try:
                if error:
                    reply = refuse(400, error)
                else:
                    # The grant may have been replaced or revoked while the media was
                    # prepared without the lock: admit under the one installed now.
                    grant, status, msg = self._submit_grant(h)
                    reply = refuse(status, msg) if grant is None else self._admit(
                        h, grant, model, sub, prompt, prompt_text, segments, leased, messages,
                        memory_on, refuse)
            finally:
                if reply is None or reply[0].status != 202:  # refused: it will not run
                    release_all(segments)
                    for src in leased:
                        self.media.unlease(src.id)
            return reply

    def _admit(self, h: Header, grant: wire.Grant, model: LoadedModel, sub: wire.Submission,
               prompt: list[int], prompt_text: str, segments: list[MediaSegment],
               leased: list[Any], messages: list[dict[str, str]], memory_on: bool,
               refuse: Callable[..., tuple[Header, bytes]]) -> tuple[Header, bytes]:
        ctx = model.engine.slot_context
        if len(prompt) >= ctx:
            return refuse(400, f"the prompt has {len(prompt)} tokens; model {model.spec.alias} "
                               f"accepts at most {ctx - 1} so that one can be generated")
        room = ctx - len(prompt)
        limit = min(self.limits.max_output_tokens, grant.max_output_tokens or 1 << 31)
        max_tokens = h.max_tokens or room
        if h.max_tokens and h.max_tokens > limit:
            return refuse(400, f"max_tokens {h.max_tokens} exceeds the limit of {limit}")
        max_tokens = min(max_tokens, room, limit)
        active = sum(m.scheduler.depth for m in self.models.values())
        if active >= self.limits.max_active:
            return refuse(429, "the device holds its maximum of active requests", 1)
        if grant.max_active:
            mine = sum(1 for r in self.requests.values()
                       if r.principal == h.principal and not r.phase.terminal)
            if mine >= grant.max_active:
                return refuse(429, f"the grant allows {grant.max_active} active requests", 1)
        if grant.rate_per_minute:
            recent = self.admissions[h.principal]
            now = time.monotonic()
            while recent and now - recent[0] >= 60:
                recent.popleft()
            if len(recent) >= grant.rate_per_minute:
                return refuse(429, f"the grant allows {grant.rate_per_minute} admissions a minute",
                              int(60 - (now - recent[0])) + 1)
            recent.append(now)
        identity = secrets.token_bytes(wire.IDENTITY_SIZE)
        seed = h.seed if h.submit_flags & wire.SUBMIT_FLAG_SEED else secrets.randbits(32)
        req = Request(identity=identity, principal=h.principal, revision=grant.revision,
                      role=h.role, prompt=prompt, max_tokens=max_tokens,
                      temperature=max(0.0, h.temperature),
                      top_p=h.top_p if 0.0 < h.top_p <= 1.0 else 1.0, seed=seed,
                      stops=tuple(s.encode() for s in sub.stop),
                      memory_off=bool(h.submit_flags & wire.SUBMIT_FLAG_MEMORY_OFF),
                      segments=segments)
        if memory_on and self.policy.enabled:
            req.source_text = "\n".join(f"{m['role'].capitalize()}: {m['content']}"
                                        for m in messages if m["role"] == "user")
        if self.log_prompts:
            log.info("event=request.prompt id=%s text=%r",
                     wire.format_request_id(self.epoch, identity), prompt_text)
        self.requests[identity] = req
        if leased:  # leased by the caller (_submit) when the request came in
            self.leases[identity] = [src.id for src in leased]
            req.media = [src.data for src in leased]
        model.scheduler.submit(req)
        self.counters.admitted += 1
        log.info("event=request.admitted id=%s role=%d prompt_tokens=%d max_tokens=%d",
                 wire.format_request_id(self.epoch, identity), h.role, len(prompt), max_tokens)
        reply = h.reply(202, epoch=self.epoch, identity=identity, **self._state_fields(req))
        return reply, b""

    def _read(self, mailbox: int, h: Header) -> tuple[Header, bytes] | None:
        req, status, msg = self._lookup(h, Action.READ)
        if req is None:
            return h.reply(status, epoch=self.epoch), msg.encode()
        if h.op == Op.WAIT and not self._wait_ready(req, h):
            timeout = min(h.max_tokens or WAIT_DEFAULT_MS, WAIT_MAX_MS) / 1000
            self._park(mailbox, req.identity, h, timeout)
            return None
        return self._read_reply(req, h)

    def _read_reply(self, req: Request, h: Header) -> tuple[Header, bytes]:
        status, body = self._window(req, h.cursor)
        return h.reply(status, epoch=self.epoch, **self._state_fields(req)), body

    @staticmethod
    def _wait_ready(req: Request, h: Header) -> bool:
        return (len(req.out) != h.cursor or req.phase != h.phase
                or req.cancel_requested != bool(h.cancel_requested) or req.phase.terminal)

    def _cancel(self, h: Header) -> tuple[Header, bytes]:
        req, status, msg = self._lookup(h, Action.CANCEL)
        if req is None:
            return h.reply(status, epoch=self.epoch), msg.encode()
        if not req.phase.terminal:
            self.models[req.role].scheduler.cancel(req)
            log.info("event=request.cancel id=%s", wire.format_request_id(self.epoch, req.identity))
            self._settle(req.identity, time.monotonic(), force=True)
        return h.reply(202, epoch=self.epoch, **self._state_fields(req)), b""

    # -- parked waits and retention (control thread, lock held) -------------------
    def _park(self, mailbox: int, identity: bytes, h: Header, timeout: float) -> None:
        self.parked[identity].append(Parked(mailbox, h, time.monotonic() + timeout))
        self.parked_mailboxes.add(mailbox)
        self.n_parked += 1

    def _settle(self, identity: bytes, now: float, force: bool = False) -> None:
        """Answer the parked waits on ``identity`` that are ready (or all, with ``force``)."""
        req = self.requests.get(identity)
        keep = []
        for p in self.parked.pop(identity, []):
            if req is None:
                self._publish(p.mailbox, p.header.reply(404, epoch=self.epoch), b"no such request")
            elif force or now >= p.deadline or self._wait_ready(req, p.header):
                self._publish(p.mailbox, *self._read_reply(req, p.header))
            else:
                keep.append(p)
                continue
            self.parked_mailboxes.discard(p.mailbox)
            self.n_parked -= 1
        if keep:
            self.parked[identity] = keep

    def _reclaim(self, now_ns: int) -> None:
        horizon = now_ns - self.limits.retention_seconds * 1_000_000_000
        while self.terminal_order:
            identity = self.terminal_order[0]
            req = self.requests.get(identity)
            if req is None:
                self.terminal_order.popleft()
                continue
            if req.finished_ns > horizon and len(self.terminal_order) <= self.limits.retention_requests:
                break
            self.terminal_order.popleft()
            del self.requests[identity]
            log.info("event=request.reclaimed id=%s", wire.format_request_id(self.epoch, identity))

    # -- mailbox loop --------------------------------------------------------------
    def _publish(self, mailbox: int, header: Header, payload: bytes) -> None:
        try:
            packet = wire.encode_packet(header, payload)
        except WireError as exc:
            packet = wire.encode_packet(header.reply(500, epoch=self.epoch), exc.message.encode())
        self.region.publish(mailbox, packet, 2)
        self.bell.ring(mailbox)

    def _take(self, i: int) -> None:
        if self.region.state(i) != REQUEST:
            return
        if i in self.parked_mailboxes or i in self.busy_mailboxes:
            return  # a parked wait, or media being prepared: answered when ready
        data = self.region.read(i)
        try:
            h, payload = wire.decode_packet(data)
        except WireError as exc:
            bad = Header(op=Op.INFO, status=exc.status, epoch=self.epoch)
            self._publish(i, bad, exc.message.encode())
            return
        try:
            result = self.handle(i, h, payload)
        except WireError as exc:
            result = h.reply(exc.status, epoch=self.epoch), exc.message.encode()
        except Exception:
            log.exception("event=device.error op=%d", h.op)
            result = h.reply(500, epoch=self.epoch), b"internal device error"
        if result is not None:
            self._publish(i, *result)

    def serve(self) -> None:
        for m in self.models.values():
            t = threading.Thread(target=m.scheduler.run, name=f"engine-{m.spec.alias}", daemon=True)
            m.thread = t
            t.start()
        if any(m.encoder is not None for m in self.models.values()):
            self._media_jobs = queue.Queue()
            self._media_thread = threading.Thread(target=self._media_worker, name="media",
                                                  daemon=True)
            self._media_thread.start()
        request_short_slice()  # after the engine and media threads started: not theirs
        log.info("event=device.ready epoch=%d models=%s mailboxes=%d", self.epoch,
                 ",".join(m.spec.alias for m in self.models.values()), self.region.count)
        pending = list(range(self.region.count))  # start-up: look at every mailbox once
        policy_failed_logged = -60.0
        last_sweep = 0.0
        last_scan = time.monotonic()
        while not self._stopping:
            with self.lock:
                for i in pending:
                    if 0 <= i < self.region.count:
                        self._take(i)
                now = time.monotonic()
                for identity in list(self.parked):
                    self._settle(identity, now)
                try:
                    self._policy_tick()
                except Exception:  # a disk error in the policy must not end the epoch
                    if now - policy_failed_logged >= 60:
                        log.exception("event=policy.tick_failed")
                        policy_failed_logged = now
                if now - last_sweep >= 1.0:
                    self._reclaim(time.monotonic_ns())
                    self.media.sweep(now)
                    last_sweep = now
                timeout = 1.0
                for waits in self.parked.values():
                    for p in waits:
                        timeout = min(timeout, max(0.0, p.deadline - now))
            try:
                ready, _, _ = select.select([self.bell.fd], [], [], timeout)
            except InterruptedError:
                continue
            pending = []
            if ready:
                got = self.bell.drain()
                if SCAN_ALL in got:
                    pending = list(range(self.region.count))
                else:
                    pending = [i for i in dict.fromkeys(got) if i != WAKE]
            if time.monotonic() - last_scan >= 1.0:
                # Once a second, busy or idle, look at every mailbox: a doorbell ring
                # lost to a full FIFO delays a packet by a second at most, never for ever.
                pending = list(range(self.region.count))
                last_scan = time.monotonic()
        if self._media_jobs is not None:
            self._media_jobs.put(None)
        for m in self.models.values():
            m.scheduler.stop()
        # The media worker may be inside an encoder (preprocessing an image) and then
        # publishes its reply: wait for it before the encoders and the region go.
        media_busy = False
        if self._media_thread is not None:
            self._media_thread.join(timeout=30)
            media_busy = self._media_thread.is_alive()
        for m in self.models.values():
            if m.thread:
                m.thread.join(timeout=30)
                if m.thread.is_alive():
                    continue  # still inside llama.cpp: leave its memory to the exit
            if m.encoder is not None:
                if media_busy:
                    continue  # the worker still uses it (and the model): leave them to the exit
                m.encoder.close()
            m.engine.close()
        if not media_busy:
            self.region.close()
        log.info("event=device.stopped epoch=%d", self.epoch)

    def stop(self) -> None:
        self._stopping = True
        self.bell.ring_self()


def run(paths: RuntimePaths, mailboxes: int, models_file: str | None = None,
        limits: DeviceLimits | None = None) -> None:
    paths.ensure()
    specs = load_specs(paths.state_dir, models_file)
    device = Device(paths, specs, mailboxes, limits)
    signal.signal(signal.SIGTERM, lambda *_: device.stop())
    signal.signal(signal.SIGINT, lambda *_: device.stop())
    device.serve()
