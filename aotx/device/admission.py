"""SUBMIT: from a submission payload to a request in a model's queue.

A text request is admitted on the control thread at once: grant and model checks,
the payload decoded, the model's chat template rendered over the whole message array
(automatic memory's facts injected first where the principal enabled it) and cut into
its markup and the messages' text (:mod:`.prompt`: only the markup's special-token
texts become control tokens), the prompt tokenized, the limits checked, the request
queued.

A raw prompt (``SUBMIT_FLAG_RAW``, a text completion's) skips the template: its text is
tokenized as text, with the BOS the model adds, or its token ids are taken as they are.

A request with media parts leases its sources (so they cannot be removed meanwhile)
and becomes a :class:`MediaJob`: decoding and preprocessing an image takes a good part
of a second, so the media worker does it without the lock, then admits the request
under the grant installed at that moment (a revoke meanwhile refuses it).  A refusal
gives the leases back.

Every refusal is a :class:`~aotx.device.errors.DeviceError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

from .. import wire
from ..engine.accept import THINK_INSIDE, THINK_NONE, THINK_UNDECIDED
from ..engine.grammar import Matcher
from ..engine.multimodal import MediaInputError, MediaProblem, MediaSegment, release_all
from ..engine.request import Failure, Request, settle
from ..wire import Header, PartKind, Reason, Role
from . import dry, tool_fields
from .constraints import constraint_matcher
from .errors import DeviceError
from .loading import LoadedModel
from .media import Source
from .memory import Source as MemorySource
from .memory import inject
from .ondemand import FAILED, Deferred
from .prompt import (
    Prompt,
    TextRefused,
    has_fields,
    markup,
    media_tokens,
    raw,
    split,
    text_tokens,
)
from .state import DeviceState
from .template import TemplateError

log = logging.getLogger("aotx.device")

Reply = tuple[Header, bytes]

#: What the projector found wrong with a media part -> the refusal (detail: the part).
MEDIA_PROBLEMS: dict[MediaProblem, tuple[int, Reason]] = {
    MediaProblem.IMAGE_UNREADABLE: (400, Reason.IMAGE_UNREADABLE),
    MediaProblem.IMAGE_PIXELS: (400, Reason.IMAGE_PIXELS),
    MediaProblem.AUDIO_UNREADABLE: (400, Reason.AUDIO_UNREADABLE),
    MediaProblem.AUDIO_RATE: (400, Reason.AUDIO_RATE),
    MediaProblem.AUDIO_LENGTH: (400, Reason.AUDIO_LENGTH),
    MediaProblem.MODALITY: (400, Reason.MODALITY),
    MediaProblem.PREPARE: (400, Reason.MEDIA_PREPARE),
}


@dataclass
class Prepared:
    """A submission checked and rendered, not yet tokenized."""

    header: Header
    grant: wire.Grant
    model: LoadedModel
    submission: wire.Submission
    prompt: Prompt
    messages: list[dict[str, Any]]
    leased: list[Source]  # media sources, in prompt order (leased from now on)
    memory_on: bool
    tokens: list[int] | None = None  # a raw prompt's token ids, as the submission gave them


@dataclass
class MediaJob:
    """A submission waiting for the media worker (its mailbox is busy): its media are
    decoded, or its constraint compiled, off the lock, which a step needs."""

    mailbox: int  # -1: a deferred request's (ondemand.py): nobody waits on a mailbox
    prepared: Prepared
    stub: Request | None = None  # the deferred request it admits


class Admission:
    def __init__(self, state: DeviceState) -> None:
        self.state = state

    def submit(self, h: Header, payload: bytes, mailbox: int) -> Reply | MediaJob:
        """Admit a text request now, or hand back the job of one whose media or constraint
        take the media worker (leasing its media meanwhile)."""
        if not self.state.loaded(h.role):
            return self._defer(h, payload)
        p = self._prepare(h, payload)
        if _dry(p) and not h.first_item:  # a dry run's first page is an admission's cost
            self.check_rate(h, p.grant)
        job = self._text_or_job(p, mailbox)
        if isinstance(job, MediaJob):
            return job
        return self._dry_end(p, job) if _dry(p) else self._admit(p, job, [])

    def _text_or_job(self, p: Prepared, mailbox: int, stub: Request | None = None
                     ) -> list[int] | MediaJob:
        """A text request's tokens, or the media worker's job (its media leased now)."""
        # (a thinking budget is a grammar too: constraints.py)
        free = p.submission.constraint is None and not (p.header.thought_budget
                                                        and _thinking(p))
        if not p.leased and (free or _dry(p)):
            return self._tokens(p)
        if p.leased and p.model.encoder is None:
            raise DeviceError(400, Reason.NO_PROJECTOR)
        for src in p.leased:
            self.state.media.lease(src)
        return MediaJob(mailbox, p, stub)

    # -- models loaded on demand (ondemand.py) --------------------------------------------
    def _defer(self, h: Header, payload: bytes) -> Reply:
        """A SUBMIT for a model not loaded yet: checked as far as it can be without the
        model, then a request in ``preparing`` that waits for the load."""
        st = self.state
        grant = st.submit_grant(h)
        if grant.max_input_bytes and len(payload) > grant.max_input_bytes:
            raise DeviceError(413, Reason.INPUT_BYTES, grant.max_input_bytes)
        wire.decode_submission(payload)  # a malformed payload is refused now
        self._check_capacity(h, grant)
        od = st.on_demand[h.role]
        if od.state == FAILED and not od.retry():
            raise DeviceError(503, Reason.MODEL_LOAD, retry_after=60)
        identity = secrets.token_bytes(wire.IDENTITY_SIZE)
        req = Request(identity=identity, principal=h.principal, revision=grant.revision,
                      role=h.role, prompt=[], max_tokens=0, phase=wire.Phase.PREPARING,
                      kept_flags=h.submit_flags & (wire.SUBMIT_FLAG_TOOLS
                                                   | wire.SUBMIT_TOOL_FORMAT))
        st.requests[identity] = req
        st.active[h.principal] += 1
        st.deferred[identity] = deferred = Deferred(req, h, payload)
        od.waiting.append(deferred)
        st.counters.admitted += 1
        log.debug("event=request.deferred id=%s role=%d", st.request_id(identity), h.role)
        return h.reply(202, epoch=st.epoch, identity=identity, **st.state_fields(req)), b""

    def admit_deferred(self, d: Deferred) -> MediaJob | None:
        """Admit a request whose model has loaded, as if it had just come (lock held); a
        refusal fails it with the refusal's status and reason."""
        self.state.deferred.pop(d.req.identity, None)
        try:
            p = self._prepare(d.header, d.payload)
            job = self._text_or_job(p, -1, d.req)
            if isinstance(job, MediaJob):
                return job
            if _dry(p):
                self._dry_end(p, job, d.req)
            else:
                self._admit(p, job, [], stub=d.req)
        except DeviceError as exc:
            self.fail_deferred(d.req, exc.status, exc.reason)
        return None

    def fail_deferred(self, req: Request, status: int, reason: Reason) -> None:
        """End a request that never reached its engine: failed with ``status``."""
        req.refused = (status, int(reason))
        settle(req, wire.Phase.FAILED, wire.Finish.NONE, Failure.REFUSED)
        self.state.ended(req)

    def _prepare(self, h: Header, payload: bytes) -> Prepared:
        st = self.state
        grant = st.submit_grant(h)
        model = st.models[h.role]
        if grant.max_input_bytes and len(payload) > grant.max_input_bytes:
            raise DeviceError(413, Reason.INPUT_BYTES, grant.max_input_bytes)
        sub = wire.decode_submission(payload)
        for token, _ in sub.sampling.bias:
            if token >= model.engine.n_vocab:
                raise DeviceError(400, Reason.LOGIT_BIAS, token)
        if lacks := model.scheduler.unsupported(sub.sampling):
            raise DeviceError(501, Reason.ENGINE_FEATURE, lacks)
        if h.submit_flags & wire.SUBMIT_FLAG_RAW:
            return self._raw(h, grant, model, sub)
        messages, media_at, leased = self._messages(h, model, sub)
        tools = tool_fields.tools(sub.tools)
        tool_fields.check_format(h.submit_flags, model.template.tool_format,
                                 tools is not None or has_fields(messages))
        tool_fields.check_text(tools, messages, model.engine.specials)
        memory_on = bool(model.automatic_memory and grant.flags & wire.GRANT_FLAG_MEMORY
                         and not h.submit_flags & wire.SUBMIT_FLAG_MEMORY_OFF and not leased)
        if memory_on:
            messages = inject(messages, st.policy.memory_for(h.principal))
            media_at = []  # no media here (memory is off with media)
        try:
            prompt = split(model.template, messages, model.engine.specials, media_at,
                           model.media_marker, tools,
                           tool_fields.template_args(sub.template_args, model.engine.specials))
        except TemplateError as exc:
            log.debug("event=request.template_refused role=%d error=%s", h.role, exc)
            raise DeviceError(400, Reason.TEMPLATE if exc.refused else Reason.TEMPLATE_FAILED
                              ) from None
        except TextRefused as exc:
            log.info("event=request.special_text role=%d message=%d", h.role, exc.message)
            # the submission's own numbering: automatic memory may have put a message first
            raise DeviceError(400, Reason.SPECIAL_TEXT,
                              max(0, exc.message - (len(messages) - len(sub.messages)))
                              ) from None
        except MediaInputError as exc:
            log.info("event=request.media_refused error=%s", exc)
            raise DeviceError(400, Reason.MEDIA_PREPARE) from None
        return Prepared(h, grant, model, sub, prompt, messages, leased, memory_on)

    @staticmethod
    def _raw(h: Header, grant: wire.Grant, model: LoadedModel, sub: wire.Submission
             ) -> Prepared:
        """A raw prompt: one user message of one part, text or token ids.  Automatic
        memory stays out of it: its facts are a system message, and there is none."""
        msg = sub.messages[0]
        if (len(sub.messages) != 1 or msg.role is not Role.USER or len(msg.parts) != 1
                or msg.parts[0].kind not in (PartKind.TEXT, PartKind.TOKENS)):
            raise DeviceError(400, Reason.MALFORMED)
        part = msg.parts[0]
        if part.kind is PartKind.TEXT:
            special = h.submit_flags & wire.SUBMIT_DRY_SPECIAL  # (a dry run's: /tokenize)
            return Prepared(h, grant, model, sub,
                            markup(part.text) if special else raw(part.text), [], [], False)
        tokens = list(struct.unpack(f"<{len(part.data) // 4}I", part.data))
        if max(tokens) >= model.engine.n_vocab:  # (the codec refuses an empty token part)
            raise DeviceError(400, Reason.PROMPT_TOKEN,
                              next(t for t in tokens if t >= model.engine.n_vocab))
        return Prepared(h, grant, model, sub, raw(""), [], [], False, tokens)

    @staticmethod
    def _tokens(p: Prepared) -> list[int]:
        """The prompt tokens of a submission without media."""
        bare = p.header.submit_flags & wire.SUBMIT_DRY_BARE  # (/tokenize's add_special false)
        tokens = (p.tokens if p.tokens is not None
                  else text_tokens(p.model.engine, p.prompt,
                                   add_special=p.model.engine.add_bos and not bare))
        if not tokens and not _dry(p):  # an empty raw text without BOS: nothing to evaluate
            raise DeviceError(400, Reason.MALFORMED)
        return tokens

    def _messages(self, h: Header, model: LoadedModel, sub: wire.Submission
                  ) -> tuple[list[dict[str, Any]], list[list[int]], list[Source]]:
        """The message array the template renders (FIELDS parts add a message's tool
        fields), where each message's media parts sit in its text (the model's media
        marker there), and the sources they name."""
        messages: list[dict[str, Any]] = []
        media_at: list[list[int]] = []
        leased: list[Source] = []
        for msg in sub.messages:
            text: list[str] = []
            at: list[int] = []
            size = 0
            extra: dict[str, Any] = {}
            for part in msg.parts:
                if part.kind is PartKind.FIELDS:
                    if extra:
                        raise DeviceError(400, Reason.MALFORMED)
                    extra = tool_fields.fields(msg.role, part.data)
                    continue
                if part.kind is PartKind.TEXT:
                    text.append(part.text)
                    size += len(part.text)
                    continue
                if part.kind is PartKind.TOKENS:  # raw prompts only
                    raise DeviceError(400, Reason.MALFORMED)
                if not model.modalities & wire.MODALITY_BITS[wire.PART_MODALITY[part.kind]]:
                    raise DeviceError(400, Reason.MODALITY, int(part.kind))
                src = self.state.media.ready_by_digest(h.principal, part.data)
                if src is None or src.kind is not part.kind:
                    raise DeviceError(404, Reason.NO_SOURCE, len(leased))
                leased.append(src)
                at.append(size)
                text.append(model.media_marker)
                size += len(model.media_marker)
            if msg.role is Role.TOOL and "tool_call_id" not in extra:
                raise DeviceError(400, Reason.MALFORMED)
            messages.append({"role": ("system", "user", "assistant", "tool")[msg.role],
                             "content": "".join(text), **extra})
            media_at.append(at)
        return messages, media_at, leased

    def run_media_job(self, job: MediaJob, held: bool = False) -> Reply:
        """Tokenize a media request without the lock, then admit it under the lock and the
        grant installed now (``held``: the caller holds the lock already, as when there is
        no media worker).  A refusal (or a failure) gives its leases back."""
        p = job.prepared
        lock: contextlib.AbstractContextManager[object] = (
            contextlib.nullcontext() if held else self.state.lock)
        segments: list[MediaSegment] = []
        admitted = False
        try:
            matcher = None if _dry(p) else constraint_matcher(
                p.model, p.submission.constraint, _thinking(p),
                max(1, (p.header.max_tokens or p.model.engine.slot_context) // 2),
                p.header.thought_budget, _channel_calls(p))
            try:
                if p.model.encoder is None or not p.leased:
                    prompt = self._tokens(p)
                else:
                    prompt, segments = media_tokens(
                        p.model.engine, p.model.encoder, p.prompt,
                        [(wire.PART_MODALITY[s.kind], s.data) for s in p.leased],
                        add_special=p.model.engine.add_bos)
            except MediaInputError as exc:
                log.debug("event=request.media_refused part=%d error=%s", exc.part, exc)
                status, reason = MEDIA_PROBLEMS[exc.problem]
                # MODALITY names the part's kind, as the device's own check does
                detail = (int(p.leased[exc.part].kind) if exc.problem is MediaProblem.MODALITY
                          else exc.part)
                raise DeviceError(status, reason, detail) from None
            except DeviceError:
                raise  # a raw prompt's own refusal (_tokens), not the media's
            except Exception:
                log.exception("event=media.error")
                raise DeviceError(400, Reason.MEDIA_PREPARE) from None
            if not prompt or prompt[-1] < 0:
                raise DeviceError(400, Reason.MEDIA_LAST)
            if _dry(p):  # (its segments and leases are given back below)
                with lock:
                    return self._dry_end(p, prompt, job.stub)
            with lock:
                # The grant may have been replaced or revoked meanwhile: admit under the
                # one installed now.
                p.grant = self.state.submit_grant(p.header)
                reply = self._admit(p, prompt, segments, matcher, job.stub)
                admitted = True
                return reply
        finally:
            if not admitted:
                release_all(segments)
                with lock:
                    for src in p.leased:
                        self.state.media.unlease(src.id)

    def _admit(self, p: Prepared, prompt: list[int], segments: list[MediaSegment],
               matcher: Matcher | None = None, stub: Request | None = None) -> Reply:
        """Check the limits and queue the request (lock held); ``stub``: the deferred
        request it becomes (counted when it was deferred)."""
        st, h, grant, model = self.state, p.header, p.grant, p.model
        max_tokens = self._output_limit(p, len(prompt))
        if stub is None:
            self._check_capacity(h, grant)
        identity = stub.identity if stub is not None else secrets.token_bytes(wire.IDENTITY_SIZE)
        seed = h.seed if h.submit_flags & wire.SUBMIT_FLAG_SEED else secrets.randbits(32)
        thinking = _thinking(p)  # (engine/accept.py counts its reasoning tokens)
        req = Request(identity=identity, principal=h.principal, revision=grant.revision,
                      role=h.role, prompt=prompt, max_tokens=max_tokens,
                      temperature=max(0.0, h.temperature),
                      top_p=h.top_p if 0.0 < h.top_p <= 1.0 else 1.0, seed=seed,
                      stops=tuple(s.encode() for s in p.submission.stop),
                      sampling=p.submission.sampling, matcher=matcher,
                      memory_off=bool(h.submit_flags & wire.SUBMIT_FLAG_MEMORY_OFF),
                      kept_flags=h.submit_flags & (wire.SUBMIT_FLAG_TOOLS
                                                   | wire.SUBMIT_TOOL_FORMAT) | thinking,
                      think=(THINK_NONE if not thinking else THINK_INSIDE
                             if thinking & wire.STATE_FLAG_THINK_OPEN else THINK_UNDECIDED),
                      think_tags=_think_tags(thinking),
                      segments=segments)
        if p.memory_on and st.policy.enabled:
            req.source_text = "\n".join(f"{m['role'].capitalize()}: {m['content']}"
                                        for m in p.messages if m["role"] == "user")
        if st.log_prompts:
            log.info("event=request.prompt id=%s tokens=%d special_tokens=%d method=%s text=%r",
                     st.request_id(identity), len(prompt),
                     sum(1 for t in prompt if t in model.engine.special_ids),
                     p.prompt.method.value, p.prompt.text)
        if stub is None:
            st.requests[identity] = req
            st.active[h.principal] += 1
            st.counters.admitted += 1
        else:  # the deferred request becomes this one (its creation time and a cancel
            # asked meanwhile kept); one ended meanwhile (cancelled) stays ended
            if stub.phase.terminal:
                return h.reply(202, epoch=st.epoch, identity=identity,
                               **st.state_fields(stub)), b""
            for f in dataclasses.fields(Request):
                if f.name not in ("created_ns", "cancel_requested"):
                    setattr(stub, f.name, getattr(req, f.name))
            req = stub
        if p.leased:  # leased when the request came in (Admission.submit)
            st.leases[identity] = [src.id for src in p.leased]
            req.media = [src.data for src in p.leased]
        model.scheduler.submit(req)
        if (od := st.on_demand.get(req.role)) is not None:
            od.used(req.principal, time.monotonic(),
                    od.asked_keep_alive(h, bool(grant.actions & wire.Action.ADMIN)))
        # A request's own events are DEBUG: at INFO every admission wrote a line to a log
        # that nothing rotates (the service's start, stop, errors and grants stay INFO).
        log.debug("event=request.admitted id=%s role=%d prompt_tokens=%d max_tokens=%d",
                 st.request_id(identity), h.role, len(prompt), max_tokens)
        # The payload: the leased sources' ids, in prompt order (the seed's media handles).
        return (h.reply(202, epoch=st.epoch, identity=identity, **st.state_fields(req)),
                b"".join(src.id for src in p.leased))

    def _dry_end(self, p: Prepared, prompt: list[int], stub: Request | None = None) -> Reply:
        """A dry run's answer (lock held): its 200, or, for one that waited for its model
        (``stub``), the whole answer as that request's output, read as any request's."""
        if stub is None:
            return dry.reply(p.header, p.model.engine, p.prompt.text, prompt, self.state.epoch)
        st, h = self.state, p.header
        if not stub.phase.terminal:  # (else it was cancelled meanwhile)
            stub.prompt = prompt
            stub.out += dry.answer(h, p.model.engine, p.prompt.text, prompt)
            settle(stub, wire.Phase.COMPLETED, wire.Finish.STOP, Failure.NONE)
            st.ended(stub)
            if (od := st.on_demand.get(stub.role)) is not None:
                od.used(stub.principal, time.monotonic(), od.asked_keep_alive(
                    h, bool(p.grant.actions & wire.Action.ADMIN)))
        return h.reply(202, epoch=st.epoch, identity=stub.identity, **st.state_fields(stub)), b""

    def _output_limit(self, p: Prepared, prompt_tokens: int) -> int:
        """The request's output token limit: what it asked, within the context and limits."""
        ctx = p.model.engine.slot_context
        if prompt_tokens >= ctx:
            raise DeviceError(400, Reason.PROMPT_LENGTH, ctx - 1,
                              fields={"prompt_tokens": prompt_tokens})
        limit = min(self.state.limits.max_output_tokens, p.grant.max_output_tokens or 1 << 31)
        asked = p.header.max_tokens
        if asked > limit:
            raise DeviceError(400, Reason.OUTPUT_TOKENS, limit)
        return min(asked or ctx - prompt_tokens, ctx - prompt_tokens, limit)

    def _check_capacity(self, h: Header, grant: wire.Grant) -> None:
        """The device's and the principal's limits on active requests and admissions (429).

        A principal holds at most its share of the device's active requests (the grant's
        ``max_active``, else ``principal_share`` of them), so a flood by one leaves room for
        the others; the refusal names the principal's own limit and nothing of the others'."""
        st = self.state
        if sum(st.active.values()) >= st.limits.max_active:
            raise DeviceError(429, Reason.DEVICE_BUSY, retry_after=1)
        share = grant.max_active or st.limits.share(st.limits.max_active)
        if st.active[h.principal] >= share:
            raise DeviceError(429, Reason.ACTIVE_LIMIT, share, retry_after=1)
        self.check_rate(h, grant)

    def check_rate(self, h: Header, grant: wire.Grant) -> None:
        """Count one admission against the grant's rate a minute (429 past it): a SUBMIT,
        or the first packet of an EMBED call."""
        st = self.state
        if grant.rate_per_minute:
            recent = st.admissions[h.principal]
            now = time.monotonic()
            while recent and now - recent[0] >= 60:
                recent.popleft()
            if len(recent) >= grant.rate_per_minute:
                raise DeviceError(429, Reason.RATE_LIMIT, grant.rate_per_minute,
                                  retry_after=int(60 - (now - recent[0])) + 1)
            recent.append(now)

    # -- engine callback (engine thread, lock held) ---------------------------------------
    def on_terminal(self, req: Request) -> None:
        """Retention, media leases and the policy's source for a request that ended (the
        device then wakes its control loop: the policy's result, a model now idle)."""
        st = self.state
        if (od := st.on_demand.get(req.role)) is not None:
            od.used(req.principal, time.monotonic())  # its keep-alive runs from here
        if req.background:
            return  # the control thread collects the policy's result
        st.ended(req)
        if req.source_text and req.phase is wire.Phase.COMPLETED:
            # The user's own words are the source: facts about the user come from what the
            # user said (the answer is not fed back, so the model cannot quote itself).
            st.policy.record(MemorySource(req.principal, req.role, req.source_text))
        for sid in st.leases.pop(req.identity, []):
            st.media.unlease(sid)


def _thinking(p: Prepared) -> int:
    """The state flags of a request whose model thinks: its output may begin with a
    think block, or (the rendering ended with ``<think>``) begins inside one."""
    if p.header.submit_flags & wire.SUBMIT_FLAG_RAW or not p.model.template.thinks:
        return 0
    if p.model.template.channels:  # gpt-oss: its answer opens a channel, analysis or final
        return wire.STATE_FLAG_THINKS | wire.STATE_FLAG_CHANNELS
    end = p.prompt.text.rstrip()
    if end.endswith("</think>"):  # the template closed it: no thinking (enable_thinking off)
        return 0
    opened = end.endswith("<think>")
    return wire.STATE_FLAG_THINKS | (wire.STATE_FLAG_THINK_OPEN if opened else 0)


def _think_tags(thinking: int) -> tuple[bytes, ...]:
    """The think block's opening and its closings (gpt-oss's: its final channel, or a
    tool call's commentary channel), as the engine counts its tokens."""
    calls = (wire.CHANNEL_CALL,) if thinking & wire.STATE_FLAG_CHANNELS else ()
    return tuple(t.encode() for t in (*wire.think_tags(thinking), *calls))


def _channel_calls(p: Prepared) -> bool:
    """Whether the constraint is gpt-oss's tool calls, which choose the channel after the
    analysis one."""
    flags = p.header.submit_flags
    return bool(flags & wire.SUBMIT_FLAG_TOOLS) and \
        wire.submit_tool_format(flags) is wire.ToolFormat.HARMONY


def _dry(p: Prepared) -> bool:
    return bool(p.header.submit_flags & wire.SUBMIT_FLAG_DRY)
