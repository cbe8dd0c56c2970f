"""The device process: one runtime activation (epoch) serving the mailboxes.

Threads
-------
* The **control thread** (the process's main thread) waits on the device doorbell,
  takes each published mailbox, answers it (:mod:`.handlers`) and publishes the reply.
  Admissions, reads, cancellations and telemetry never wait for a decode step.
  ``WAIT`` packets (a subscriber waiting for new bytes), alone or grouped in a
  ``WAITS``, are parked (:mod:`.waits`) and answered as soon as the engine produces
  bytes or the request changes state.
* One **engine thread** per model runs its :class:`~aotx.engine.llama.scheduler.Scheduler`.
  After each step it rings the device's own doorbell when packets are parked, so the
  control thread answers them without polling.
* The **media worker** (models with a projector) prepares media submissions without
  the lock; their mailboxes stay busy until it answers.
* **Embeddings** (EMBED) are checked and tokenized by the control thread and computed
  by the model's engine thread between two decode steps; the mailbox stays busy until
  the engine thread answers it (:meth:`Device._embedded`).

All request state lives in :class:`~aotx.device.state.DeviceState`, guarded by one
lock, held briefly by every thread and never during ``llama_decode``.  A refusal
becomes a reply in one place: :meth:`Device.reply_to`.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
import queue
import secrets
import select
import signal
import threading
import time
from collections.abc import Callable

from .. import wire
from ..config import Settings
from ..cpuslice import request_short_slice
from ..engine.embedding import EmbedJob
from ..engine.request import Request
from ..engine.spec import ModelSpec
from ..mailbox import REQUEST, SCAN_ALL, WAKE, Bell, Region
from ..paths import RuntimePaths, clear_vllm_sockets, vllm_sockets
from ..wire import Header, Op, Reason, WireError
from . import fleet
from .admission import Admission, MediaJob
from .catalog import folder_specs, settle_roles
from .embeddings import EmbedCall, withdraw_due
from .embeddings import reply as embed_reply
from .epoch import next_epoch
from .errors import DeviceError
from .handlers import Handlers, Park, Reply, Result
from .loading import LoadedModel, load_model
from .memory import EXTRACTION_MAX_TOKENS, EXTRACTION_PROMPT, MAX_SOURCE_CHARS
from .models import load_specs
from .ondemand import (
    FAILED,
    LOADED,
    LOADING,
    UNLOADED,
    UNLOADING,
    Deferred,
    Hasher,
    Loader,
    OnDemand,
    describe_all,
    file_identity,
    why,
)
from .policy import Policy
from .prompt import TextRefused, split, text_tokens
from .state import DeviceLimits, DeviceState
from .template import TemplateError
from .waits import Waits
from .watch import Watch

log = logging.getLogger("aotx.device")
#: The requests a stream sends every token: a pass that takes only these (and the
#: answers a step's end makes due) changes nothing the housekeeping looks at.
READS = frozenset((Op.READ, Op.WAIT, Op.WAITS))
#: The longest a busy control loop goes without its housekeeping.
QUIET_PASS_S = 0.05


def start_timers() -> dict[str, float]:
    """The control loop's clocks at start-up (``Device._pass``; monotonic seconds)."""
    return {"policy_failed": -60.0, "sweep": 0.0, "scan": time.monotonic(), "full": 0.0,
            "embeds_due": math.inf}


class Device:
    def __init__(self, paths: RuntimePaths, specs: list[ModelSpec], mailboxes: int,
                 limits: DeviceLimits | None = None, log_prompts: bool = False,
                 short_slice: bool = True) -> None:
        self.paths = paths
        self.short_slice = short_slice
        paths.ensure()
        self._lockfile = os.open(os.path.join(paths.run_dir, "device.lock"),
                                 os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another device is running on {paths.state_dir}") from None
        clear_vllm_sockets(paths)  # (under the lock)
        limits = limits or DeviceLimits()
        self.state = st = DeviceState(next_epoch(paths, limits.device_id), limits,
                                      Policy(os.path.join(paths.state_dir, "memory"), False),
                                      log_prompts)
        self.region = Region(paths.region, mailboxes)
        self.bell = Bell(paths.device_bell, paths.broker_bell)
        self.admission = Admission(st)
        # Set by what asks the control loop's next pass for its housekeeping (``wake``:
        # a handler, the loader, the watcher, a request's end; a request but a read).
        self._full = True
        self.handlers = Handlers(st, self.admission, mailboxes, self.wake,
                                 lambda identity: self.waits.force(identity))
        self.waits = Waits(st, self.handlers, self.reply_to, self._publish)
        self.busy_mailboxes: set[int] = set()  # submissions whose media is being prepared
        self._rings: list[int] | None = None  # a pass's replies, rung together at its end
        self._media_jobs: queue.Queue[MediaJob | None] | None = None  # the media worker's
        self._media_thread: threading.Thread | None = None
        self._stopping = False
        self.failed = ""  # why the device stops on its own (engine_failed)
        # llama.cpp contexts first: they are created while no other thread runs
        # (engine/residency.py), and vLLM's AsyncLLM starts threads of its own.
        for spec in sorted(specs, key=lambda s: s.engine == "vllm"):
            if not spec.on_demand:
                st.models[spec.role] = load_model(spec, paths.state_dir, st.lock,
                                                  self._after_step, self.on_terminal,
                                                  list(st.models.values()))
        st.models = dict(sorted(st.models.items()))  # in role order again
        st.on_demand = describe_all([s for s in specs if s.on_demand])
        st.budget = limits.memory_budget or fleet.default_budget(fleet.total_memory())
        self.watch: Watch | None = None  # the models folder, looked at again (run)
        self.hasher = Hasher(list(st.on_demand.values()),
                             os.path.join(paths.state_dir, "model-hashes.json"))
        self.loader = Loader(lambda spec: load_model(spec, paths.state_dir, st.lock,
                                                     self._after_step, self.on_terminal),
                             self.wake)
        st.policy = Policy(os.path.join(paths.state_dir, "memory"),
                           enabled=any(m.automatic_memory for m in st.models.values()))

    @property
    def epoch(self) -> int:
        return self.state.epoch

    # -- engine callbacks (engine thread; the lock is held for on_terminal) ----------------
    def on_terminal(self, req: Request) -> None:
        self.admission.on_terminal(req)
        # Once a request: its model may now be idle (an unload asked, a keep-alive of
        # 0, a load waiting for room) and the policy may start its work.
        self.wake()

    def _after_step(self) -> None:
        if self.handlers.parked_waits:  # (answers due: no housekeeping asked)
            self.bell.ring_self()

    def wake(self) -> None:
        """Wake the control loop for a pass with its housekeeping (any thread)."""
        self._full = True
        self.bell.ring_self()

    # -- replies -----------------------------------------------------------------------------
    def reply_to(self, h: Header, work: Callable[[], Result | None]) -> Result | None:
        """Run ``work`` for the request ``h``: the one place where a handler's refusal
        (DeviceError, WireError) or failure becomes a reply, and where refused submissions
        are counted.  (A packet the codec cannot read has no request to answer: ``_take``
        replies with the codec's status; a reply that cannot be encoded becomes a 500.)"""
        epoch = self.state.epoch
        try:
            result = work()
        except DeviceError as exc:
            result = (h.refuse(exc.status, exc.reason, exc.detail, exc.retry_after, epoch=epoch,
                               **exc.fields), exc.payload)
        except WireError as exc:
            log.info("event=device.refused op=%d reason=%s error=%s", h.op, exc.reason.name,
                     exc.message)
            result = h.refuse(exc.status, exc.reason, exc.detail, epoch=epoch), b""
        except Exception:
            log.exception("event=device.error op=%d", h.op)
            result = h.refuse(500, Reason.INTERNAL, epoch=epoch), b""
        if (isinstance(result, tuple) and h.op in (Op.SUBMIT, Op.EMBED)
                and result[0].status >= 400 and result[0].reason != Reason.WITHDRAWN
                and not (h.op == Op.SUBMIT and h.flags & wire.SUBMIT_FLAG_DRY)):
            self.state.counters.refused[result[0].status] += 1  # (a withdrawal refuses none)
        return result

    def _publish(self, mailbox: int, header: Header, payload: bytes) -> None:
        try:
            packet = wire.encode_packet(header, payload)
        except WireError as exc:
            log.error("event=device.unencodable op=%d error=%s", header.op, exc.message)
            packet = wire.encode_packet(header.refuse(500, Reason.INTERNAL,
                                                      epoch=self.state.epoch))
        self.region.publish(mailbox, packet, 2)
        if self._rings is not None:
            self._rings.append(mailbox)
        else:
            self.bell.ring(mailbox)

    def _take(self, i: int) -> None:
        """Answer mailbox ``i`` if it holds a request (control thread, lock held)."""
        if self.region.state(i) != REQUEST:
            return
        if i in self.waits.by_mailbox or i in self.busy_mailboxes:
            return  # a parked wait, or media being prepared: answered when ready
        data = self.region.read(i)
        try:
            h, payload = wire.decode_packet(data)
        except WireError as exc:
            log.info("event=device.bad_packet mailbox=%d error=%s", i, exc.message)
            tag = int.from_bytes(data[16:24], "little") if len(data) >= 24 else 0
            bad = Header(op=Op.INFO, status=exc.status, reason=int(exc.reason), tag=tag,
                         epoch=self.state.epoch, value=exc.detail)
            self._publish(i, bad, b"")
            return
        if h.op not in READS:
            self._full = True  # (a request may change what the housekeeping looks at)
        reply = self.respond(i, h, payload)
        if reply is not None:
            self._publish(i, *reply)

    def respond(self, mailbox: int, h: Header, payload: bytes) -> Reply | None:
        """The reply to one request (lock held), or None when it is answered later: a
        WAIT or a WAITS parked, a media submission handed to the media worker."""
        if h.op == Op.WAITS:
            group = self.reply_to(h, functools.partial(self.waits.open_group, mailbox, h,
                                                       payload))
            assert group is None or isinstance(group, tuple)
            return group
        result = self.reply_to(h, functools.partial(self.handlers.handle, mailbox, h, payload))
        if isinstance(result, Park):
            self.waits.park(mailbox, h, (h,), (result.deadline,))
            return None
        if isinstance(result, MediaJob):
            if self._media_jobs is None:  # no worker (tests drive respond() directly)
                job = functools.partial(self.admission.run_media_job, result, held=True)
                done = self.reply_to(h, job)
                assert isinstance(done, tuple)
                return done
            self.busy_mailboxes.add(mailbox)
            self._queue_media(result)
            return None
        if isinstance(result, EmbedCall):
            self.busy_mailboxes.add(mailbox)
            self.handlers.embeds[(h.principal, h.identity)] = result
            result.job = EmbedJob(result.inputs, functools.partial(self._embedded, result),
                                  h.principal)
            result.queue.submit(result.job)
            return None
        return result

    def _embedded(self, call: EmbedCall, job: EmbedJob) -> None:
        """Answer an EMBED whose inputs are all embedded (engine thread, lock held), or
        that was withdrawn (control thread)."""
        result = self.reply_to(call.header, functools.partial(embed_reply, self.state, call, job))
        assert isinstance(result, tuple)
        self.handlers.embeds.pop((call.header.principal, call.header.identity), None)
        self.busy_mailboxes.discard(call.mailbox)
        self._full = True  # (its model may be idle now)
        self._publish(call.mailbox, *result)

    # -- media submissions (the media worker) -------------------------------------------------
    def _queue_media(self, job: MediaJob) -> None:
        """Hand ``job`` to the media worker (lock held); until it is admitted or refused
        its model counts as busy: the worker uses the model without the lock."""
        assert self._media_jobs is not None
        self.state.preparing[job.prepared.header.role] += 1
        self._media_jobs.put(job)

    def _media_worker(self) -> None:
        assert self._media_jobs is not None
        while (job := self._media_jobs.get()) is not None:
            result = self.reply_to(job.prepared.header,
                                   functools.partial(self.admission.run_media_job, job))
            assert isinstance(result, tuple)
            with self.state.lock:
                self.state.preparing[job.prepared.header.role] -= 1
                if job.stub is not None:  # a deferred request's: its reply is its state
                    if result[0].status >= 400:
                        self.admission.fail_deferred(job.stub, result[0].status,
                                                     Reason(result[0].reason))
                    if job.stub.phase.terminal:  # (failed, or a dry run's answer is whole)
                        self.waits.force(job.stub.identity)
                    continue
                self.busy_mailboxes.discard(job.mailbox)
                self._publish(job.mailbox, *result)

    # -- models loaded on demand (control thread, lock held) ---------------------------------
    def _on_demand(self) -> None:
        """Install the models whose load ended and admit their requests (a failed load
        fails them); unload the models idle past their keep-alive; start the loads
        requests wait for, unloading others first when the budget says so.  An unload
        that ended is seen first, so that the load it made room for starts in the same
        pass (not at the next wake-up)."""
        st = self.state
        for od, result, seconds in self.loader.finished():
            self._finished(od, result, seconds)
        now = time.monotonic()
        for od in st.on_demand.values():
            resident = self._resident(od)
            if od.unload_asked:  # (an admin's: as soon as its requests have ended)
                resident.keep_alive, resident.users = 0, {}
            if od.state == LOADED and fleet.expired([resident], now):
                self.loader.unload(od, st.models.pop(od.spec.role))
        for od in st.on_demand.values():
            if od.asked and now - od.asked > st.limits.load_wait_seconds:
                od.asked = 0.0  # an admin's load that found no room in time
            if od.state == UNLOADED and (od.waiting or od.asked):
                self._make_room(od, now)

    def _finished(self, od: OnDemand, result: LoadedModel | Exception | None,
                  seconds: float) -> None:
        """A load or unload of ``od`` ended (the loader's result: the model, the load's
        failure, or None for an unload)."""
        if result is None:  # an unload ended: its memory is back, and nobody holds it
            od.state, od.unload_asked = UNLOADED, False
            od.users.clear()
            return
        od.asked = 0.0
        od.loads += 1
        od.load_seconds += seconds
        waiting, od.waiting = od.waiting, []
        if isinstance(result, Exception):
            od.state, od.reason, od.unload_asked = FAILED, why(od.spec, result), False
            if (file := file_identity(od.spec.path)) != (0, 0):
                od.failed_file = file
            self._fail_waiting(waiting, 503, Reason.MODEL_LOAD)
            return
        self._install(result)
        od.state, od.sha256 = LOADED, result.sha256
        od.used(0, time.monotonic())
        log.info("event=model.loaded_on_demand alias=%s seconds=%.1f waiting=%d",
                 od.spec.alias, seconds, len(waiting))
        for d in waiting:
            job = self.admission.admit_deferred(d)
            if job is not None and self._media_jobs is not None:
                self._queue_media(job)
            self.waits.force(d.req.identity)

    def _make_room(self, od: OnDemand, now: float) -> None:
        """Load ``od`` when it fits the budget beside the others (fleet.py), unloading
        what the rule allows first; else let its requests wait, at most the load wait."""
        st = self.state
        if any(o.state == UNLOADING for o in st.on_demand.values()):
            return  # room being made: plan again once it is (else it would unload more)
        others = [self._resident(o) for o in st.on_demand.values()
                  if o is not od and o.state in (LOADING, LOADED)]
        fixed = sum(m.engine.model_bytes + m.engine.kv_bytes() for m in st.engines()
                    if m.spec.role not in st.on_demand)
        principal = od.waiting[0].req.principal if od.waiting else od.asked_by
        try:
            plan = fleet.plan_room(od.memory_bytes, st.budget - fixed, others, principal, now)
        except fleet.NeverFits as exc:
            log.warning("event=model.never_fits alias=%s %s", od.spec.alias, exc)
            od.state, od.reason, od.asked = FAILED, why(od.spec, exc), 0.0
            od.unload_asked = False
            waiting, od.waiting = od.waiting, []
            self._fail_waiting(waiting, 503, Reason.MODEL_LOAD)
            return
        if plan == []:
            self.loader.start(od)
            return
        for r in plan or ():
            victim = next(o for o in st.on_demand.values() if o.spec.role == r.role)
            victim.evictions += 1
            log.info("event=model.evict alias=%s for=%s", victim.spec.alias, od.spec.alias)
            self.loader.unload(victim, st.models.pop(r.role))
        if plan is None:  # no room now: requests past the load wait get 503
            late = [d for d in od.waiting if now - d.since > st.limits.load_wait_seconds]
            od.waiting = [d for d in od.waiting if d not in late]
            self._fail_waiting(late, 503, Reason.MODEL_ROOM)

    def _resident(self, od: OnDemand) -> fleet.Resident:
        role = od.spec.role
        busy = (od.state != LOADED or role not in self.state.models or self.state.working(role)
                or any(c.header.role == role for c in self.handlers.embeds.values()))
        return od.resident(busy)

    def _fail_waiting(self, waiting: list[Deferred], status: int, reason: Reason) -> None:
        for d in waiting:
            self.state.deferred.pop(d.req.identity, None)
            self.admission.fail_deferred(d.req, status, reason)
            self.waits.force(d.req.identity)

    def _install(self, model: LoadedModel) -> None:
        st = self.state
        st.models[model.spec.role] = model
        st.models = dict(sorted(st.models.items()))
        self._start_engine(model)
        if self._media_jobs is None:
            self._start_media_worker()
        if model.automatic_memory:  # (decided when a model is loaded, as at start)
            st.policy.enable()

    # -- the resident policy (control thread, lock held) ------------------------------------
    def policy_tick(self) -> None:
        st = self.state

        def busy() -> bool:  # asked only when the policy would start work
            return any(not r.background for m in st.models.values()
                       for r in (*m.scheduler.queue, *m.scheduler.active))

        source = st.policy.tick(busy)
        if source is None:
            return
        model = st.models.get(source.role)
        if model is None:  # (a model loaded on first use, unloaded since)
            st.policy.drop("its model is not loaded")
            return
        messages = [{"role": "system", "content": EXTRACTION_PROMPT},
                    {"role": "user", "content": source.text[-MAX_SOURCE_CHARS:]}]
        try:
            # The user's words are text: special-token texts in them stay text here too.
            prompt = text_tokens(model.engine, split(model.template, messages,
                                                     model.engine.specials),
                                 add_special=model.engine.add_bos)
        except (TemplateError, TextRefused) as exc:
            st.policy.drop(f"{type(exc).__name__}: {exc}")
            return
        prompt = prompt[-(model.engine.slot_context - EXTRACTION_MAX_TOKENS - 1):]
        work = Request(identity=secrets.token_bytes(16), principal=0, revision=0,
                       role=source.role, prompt=prompt, max_tokens=EXTRACTION_MAX_TOKENS,
                       background=True)
        st.policy.started(work)
        model.scheduler.submit(work)

    # -- the control loop -----------------------------------------------------------------------
    def _start_threads(self) -> None:
        for m in self.state.models.values():
            if not m.shares_engine:  # (a LoRA adapter: its base model's thread runs it)
                self._start_engine(m)
        if self.state.models:  # media, and constraints to compile, for every model
            self._start_media_worker()
        self.hasher.start()

    def _start_engine(self, m: LoadedModel) -> None:
        m.scheduler.on_fatal = functools.partial(self.engine_failed, m.spec.alias)
        m.thread = threading.Thread(target=m.scheduler.run, name=f"engine-{m.spec.alias}",
                                    daemon=True)
        m.thread.start()

    def _start_media_worker(self) -> None:
        self._media_jobs = queue.Queue()
        self._media_thread = threading.Thread(target=self._media_worker, name="media",
                                              daemon=True)
        self._media_thread.start()

    def _pass(self, pending: list[int], timers: dict[str, float]) -> float:
        """One pass of the control loop (lock held): the mailboxes in ``pending``, the
        parked waits and, when asked (``wake``) or every ``QUIET_PASS_S`` at least, the
        housekeeping (loads and unloads, the models folder, the policy, withdrawn embedding
        calls, once a second retention).  Returns how long to sleep at most."""
        st = self.state
        # The pass's replies are rung in one write at its end: the broker wakes once for
        # them and sends them together, so the streams a step advanced get theirs in one
        # burst and send their next WAITs in one group (gateway/broker_client.py).
        self._rings = []
        try:
            for i in pending:
                if 0 <= i < self.region.count:
                    self._take(i)
            now = time.monotonic()
            # A pass woken only by a step's end or by reads and WAITs (a stream's every
            # token) leaves the housekeeping to the next pass asked for it: it was a
            # fifth of the control thread's time a token (cProfile, one stream).
            full = (self._full or now - timers["full"] >= QUIET_PASS_S
                    or now >= timers["embeds_due"])
            if full:
                self._full = False
                timers["full"] = now
                self._on_demand()
                if self.watch is not None:
                    self.watch.step(st, now)
            self.waits.settle(now)
            if full:  # (callers given up)
                timers["embeds_due"] = withdraw_due(self.handlers.embeds, now)
        finally:
            rings, self._rings = self._rings, None
            self.bell.ring_many(rings)
        if full:
            self._housekeeping(now, timers)
        return min(self.waits.next_deadline(now, 1.0), max(0.0, timers["embeds_due"] - now))

    def _housekeeping(self, now: float, timers: dict[str, float]) -> None:
        """The policy's tick and, once a second, retention (lock held)."""
        st = self.state
        try:
            self.policy_tick()
        except Exception:  # a disk error in the policy must not end the epoch
            if now - timers["policy_failed"] >= 60:
                log.exception("event=policy.tick_failed")
                timers["policy_failed"] = now
        if now - timers["sweep"] >= 1.0:
            st.reclaim(time.monotonic_ns())
            st.media.sweep(now)
            timers["sweep"] = now

    def serve(self) -> None:
        self._start_threads()
        request_short_slice(self.short_slice)  # after the engine and media threads: not theirs
        log.info("event=device.ready epoch=%d models=%s mailboxes=%d", self.state.epoch,
                 ",".join(m.spec.alias for m in self.state.models.values()), self.region.count)
        pending = list(range(self.region.count))  # start-up: look at every mailbox once
        timers = start_timers()
        while not self._stopping:
            with self.state.lock:
                timeout = self._pass(pending, timers)
            try:
                ready, _, _ = select.select([self.bell.fd], [], [], timeout)
            except InterruptedError:
                continue
            pending = []
            if not ready:  # a deadline (a WAIT's, an embedding call's), or the idle second
                self._full = True
            else:
                got = self.bell.drain()
                if SCAN_ALL in got:
                    pending = list(range(self.region.count))
                else:
                    pending = [i for i in dict.fromkeys(got) if i != WAKE]
            if time.monotonic() - timers["scan"] >= 1.0:
                # Once a second, busy or idle, look at every mailbox: a doorbell ring lost
                # to a full FIFO delays a packet by a second at most, never for ever.
                pending = list(range(self.region.count))
                timers["scan"] = time.monotonic()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._media_jobs is not None:
            self._media_jobs.put(None)
        for t in self.loader.threads:  # a load in progress: its model is not installed
            t.join(timeout=60)
        models = self.state.models.values()
        for m in models:
            m.scheduler.stop()
        # The media worker may be inside an encoder (preprocessing an image) and then
        # publishes its reply: wait for it before the encoders and the region go.
        media_busy = False
        if self._media_thread is not None:
            self._media_thread.join(timeout=30)
            media_busy = self._media_thread.is_alive()
        slow: list[threading.Thread] = []
        for m in models:
            if m.thread:
                m.thread.join(timeout=30)
                if m.thread.is_alive():
                    continue  # still inside llama.cpp: leave its memory to the exit
            if m.encoder is not None and media_busy:
                continue  # the worker still uses it (and the model): leave them to the exit
            if m.engine.closes_slowly and not m.shares_engine:  # (vLLM's: engine-core process)
                slow.append(threading.Thread(target=m.close, name=f"close-{m.spec.alias}"))
            else:
                m.close()
        # Each vLLM engine waits seconds for its engine-core process to end: all at once,
        # else four of them outlast the supervisor's grace (10 s) and it kills the device
        # before the last engine core was told to go, which then outlives it.
        for t in slow:
            t.start()
        for t in slow:
            t.join(timeout=30)
        if not media_busy:
            self.region.close()
        log.info("event=device.stopped epoch=%d", self.state.epoch)

    def stop(self) -> None:
        self._stopping = True
        self.bell.ring_self()

    def engine_failed(self, alias: str, why: str) -> None:
        """A model's engine cannot serve (vLLM's engine core died, an adapter did not
        load): stop, and exit with the reason, so that the supervisor starts a new device
        (a new epoch)."""
        self.failed = f"model {alias}: {why}"
        self.stop()


def run(paths: RuntimePaths, mailboxes: int, models_file: str | None = None,
        limits: DeviceLimits | None = None, settings: Settings | None = None,
        models_dir: str | None = None) -> None:
    settings = settings or Settings()
    paths.ensure()
    vllm_sockets(paths)
    declared = load_specs(paths.state_dir, models_file)
    models_dir = models_dir or os.path.join(paths.state_dir, "models")
    found = folder_specs(models_dir, declared)
    specs = settle_roles(paths.state_dir, declared, found)
    device = Device(paths, specs, mailboxes, limits, settings.log_prompts, settings.short_slice)
    given = {s.alias for s in specs}
    device.state.unassigned = [(f.alias, f.path) for f in found if f.alias not in given]
    device.watch = Watch(models_dir, paths.state_dir, declared, device.wake)
    signal.signal(signal.SIGTERM, lambda *_: device.stop())
    signal.signal(signal.SIGINT, lambda *_: device.stop())
    device.serve()
    if device.failed:
        raise SystemExit(f"device: {device.failed}")
