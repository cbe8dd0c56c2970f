"""vLLM behind the device's engine contract: the engine owns batching and KV.

A model with ``engine = "vllm"`` in the models file is served by vLLM's ``AsyncLLM``
(``vllm.v1.engine.async_llm``), driven through vLLM's ``EngineClient`` protocol:
``generate`` (token ids in, token ids out, one ``RequestOutput`` of new tokens at a
time), ``abort`` by request id, ``check_health``.  Tensor, pipeline and data
parallelism, Ray across nodes, paged KV and prefix caching are vLLM's, configured
by name in ``[model.vllm]``.

The device keeps what the seed gives it: identities and epochs, grants, the byte
cursors and every output byte, retention, media, the resident policy.  So the
prompt is rendered and tokenized here (engine/hfvocab.py), and each token vLLM
samples becomes bytes here, through the same :class:`OutputBuffer` as llama.cpp's
(UTF-8 boundaries, stop strings); when aotx ends a request first (a stop string,
a cancel) it aborts vLLM's.

:class:`VllmRunner` stands where :class:`~aotx.engine.llama.scheduler.Scheduler` stands for
llama.cpp: the control thread calls ``submit`` and ``cancel`` with the device lock
held; the engine thread runs an asyncio loop (``run``) with one task per request,
and applies each output under the lock.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ...wire import EngineFeature, Finish, Phase, Sampling
from ..accept import accept
from ..grammar import JSON_OPTIONS, GrammarSpec
from ..interface import EngineError, EngineStats
from ..logprobs import Annotations, Entry, line
from ..output import OutputBuffer
from ..request import Failure, Request, settle
from .client import EngineClient
from .inputs import multi_modal_data, reason

log = logging.getLogger("aotx.engine")


ParamsFactory = Callable[[Request], Any]
#: Seconds between two health checks of vLLM's engine (``EngineClient.check_health``:
#: a flag vLLM sets when its engine core process has gone, so the check costs nothing).
HEALTH_S = 1.0


class VllmRunner:
    def __init__(self, client: EngineClient, vocab: Any, lock: threading.Lock,
                 make_params: ParamsFactory,
                 on_step: Callable[[], None] = lambda: None,
                 on_terminal: Callable[[Request], None] = lambda r: None) -> None:
        self.client = client
        self.vocab = vocab  # HfVocab: piece, is_eog, slot_context
        self.lock = lock
        self.make_params = make_params
        self.on_step = on_step
        self.on_terminal = on_terminal
        self.queue: collections.deque[Request] = collections.deque()  # sent, no token yet
        self.active: list[Request] = []  # producing tokens
        self.tick = 0  # outputs applied
        self.stats = EngineStats()  # counts and latencies (the device's /metrics)
        self.side = None  # no embedding work on this engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._tasks: dict[bytes, asyncio.Task[None]] = {}
        self._calls: set[asyncio.Task[None]] = set()  # other work (embeddings)
        self._pending: list[Callable[[], None]] = []  # asked for before the loop runs
        self.loras: dict[int, Any] = {}  # model role -> vLLM's LoRARequest (lora_request)
        self._step_due = False  # an on_step call is scheduled (_stepped)
        # The engine cannot serve (vLLM's engine core died, an adapter did not load):
        # every request would fail until the device is restarted, and the device's
        # exit does that (a new epoch).
        self.on_fatal: Callable[[str], None] = lambda why: None
        self.health_s = HEALTH_S
        self._ready = asyncio.Event()  # set once the adapters are loaded (_add_loras)

    @property
    def depth(self) -> int:
        return len(self.queue) + len(self.active)

    def warm(self, prefix: list[int]) -> None:
        """Nothing to warm: vLLM caches prefixes itself."""

    def unsupported(self, sampling: Sampling) -> EngineFeature | None:
        return unsupported(sampling)

    def add_adapter(self, role: int, alias: str, path: str) -> None:
        """Serve the LoRA adapter at ``path`` as model ``role`` (loaded when the loop starts)."""
        self.loras[role] = lora_request(alias, role, path)

    # -- called with the lock held (control thread) -------------------------
    def submit(self, req: Request) -> None:
        req.phase = Phase.QUEUED
        req.buffer = OutputBuffer(req.stops)
        if req.sampling.logprobs:
            req.notes = Annotations(req.sampling.logprobs - 1)
        self.queue.append(req)
        self.stats.prompt_tokens_in += len(req.prompt)
        self.call_soon(lambda: self._start(req))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread's loop (lock held: from any thread)."""
        if self._loop is None:
            self._pending.append(fn)
        else:
            self._loop.call_soon_threadsafe(fn)

    def spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``work()`` as a task of the loop, cancelled when it stops (lock held)."""
        def start() -> None:
            task = asyncio.get_running_loop().create_task(work())
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        self.call_soon(start)

    def cancel(self, req: Request) -> None:
        if req.phase.terminal:
            return
        req.cancel_requested = True  # (before the loop runs: _start sees it)
        if self._loop is not None and not self._stopping:
            self._loop.call_soon_threadsafe(self._cancel, req)

    def engine_metrics(self) -> dict[str, object]:
        """vLLM's scheduler figures, for /metrics under vLLM's names (render.py)."""
        figures = getattr(self.vocab, "figures", None)
        return figures.metrics() if figures is not None else {}

    # -- the engine thread --------------------------------------------------
    def run(self) -> None:
        """The engine thread: an asyncio loop with a task per request, until ``stop``."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        with self.lock:
            self._loop = loop
            for fn in self._pending:
                loop.call_soon(fn)
            self._pending.clear()
            if self._stopping:  # stopped before this thread got here
                loop.call_soon(loop.stop)
        watch = loop.create_task(self._watch())
        boot = loop.create_task(self._add_loras())
        try:
            loop.run_forever()
        finally:
            tasks = [*self._tasks.values(), *self._calls, watch, boot]
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        with self.lock:
            if self._stopping:  # (once, whichever of its aliases asks first)
                return
            self._stopping = True
            loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    async def _watch(self) -> None:
        """vLLM's ``check_health`` every ``health_s``: the first failure calls ``on_fatal``
        (vLLM's own server exits then too)."""
        while True:
            await asyncio.sleep(self.health_s)
            try:
                await self.client.check_health()
            except Exception as exc:
                why = reason(exc)
                log.error("event=vllm.engine_dead error=%s", why)
                self.on_fatal(f"its vLLM engine died: {why}")
                return

    async def _add_loras(self) -> None:
        """Load every adapter into vLLM before the first request starts (``add_lora``):
        an adapter that does not load stops the device at start, with the reason, rather
        than failing each of its requests."""
        try:
            for role, lora in self.loras.items():
                try:
                    if await self.client.add_lora(lora) is False:
                        raise EngineError("vLLM refused it")
                except Exception as exc:
                    why = reason(exc)
                    log.error("event=vllm.lora_failed role=%d error=%s", role, why)
                    self.on_fatal(f"LoRA adapter {lora.lora_name!r} did not load: {why}")
                    return
                log.info("event=vllm.lora_loaded role=%d alias=%s", role, lora.lora_name)
        finally:
            self._ready.set()

    def _start(self, req: Request) -> None:
        if req.phase.terminal:
            return
        if req.cancel_requested:  # cancelled before the loop reached it
            self._ended_unstarted(req)
            return
        task = asyncio.get_running_loop().create_task(self._generate(req))
        self._tasks[req.identity] = task
        # A task cancelled before its first step never runs _generate's handlers: the
        # request ends here then (vLLM never saw it, so there is nothing to abort).
        task.add_done_callback(lambda _: self._ended_unstarted(req))

    def _ended_unstarted(self, req: Request) -> None:
        self._tasks.pop(req.identity, None)
        with self.lock:
            if req.phase.terminal:
                return
            self._end_if_running(req, Phase.CANCELLED)
        self._stepped()

    def _cancel(self, req: Request) -> None:
        task = self._tasks.get(req.identity)
        if task is not None:  # (not started yet: _start sees cancel_requested)
            task.cancel()

    async def _generate(self, req: Request) -> None:
        rid = req.identity.hex()
        engine_done = False  # vLLM has ended the request itself
        try:
            await self._ready.wait()  # the adapters are loaded (_add_loras)
            prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt)}
            if req.segments:
                prompt["multi_modal_data"] = multi_modal_data(req.segments)
            stream = self.client.generate(prompt, self.make_params(req), rid,
                                          lora_request=self.loras.get(req.role))
            async for out in stream:
                completion = out.outputs[0]
                engine_done = bool(out.finished)
                with self.lock:
                    if req.segments and out.prompt_token_ids:
                        self._expanded(req, out.prompt_token_ids)
                    ended = self._apply(req, list(completion.token_ids),
                                        completion.finish_reason, engine_done,
                                        completion.logprobs)
                self._stepped()
                if ended:
                    break
            with self.lock:  # vLLM ended without saying why: the output is whole
                self._end_if_running(req, Phase.COMPLETED, Finish.STOP)
        except asyncio.CancelledError:
            with self.lock:
                self._end_if_running(req, Phase.CANCELLED)
        except Exception:
            log.exception("event=vllm.request_failed id=%s", rid)
            with self.lock:
                self._end_if_running(req, Phase.FAILED, failure=Failure.DECODE)
        finally:
            self._stepped()
        try:
            if not engine_done:
                await self.client.abort(rid)  # aotx ended it first: vLLM's work stops too
        finally:
            self._tasks.pop(req.identity, None)  # (after the abort: a shutdown waits for it)

    def _expanded(self, req: Request, prompt: list[int]) -> None:
        """The prompt as vLLM's processor made it (each image or audio token expanded to
        the part's positions): its length is what the usage counts (lock held)."""
        self.stats.prompt_tokens_in += len(prompt) - len(req.prompt)
        req.prompt = list(prompt)
        req.segments = []  # (vLLM has the decoded media now)

    def _stepped(self) -> None:
        """New bytes: the device answers the WAITs they satisfy, once for all the outputs
        of one vLLM step (they wake their tasks in the same loop iteration; the call
        runs after them)."""
        if not self._step_due:
            self._step_due = True
            asyncio.get_running_loop().call_soon(self._step)

    def _step(self) -> None:
        self._step_due = False
        self.on_step()

    def _apply(self, req: Request, tokens: list[int], reason: str | None,
               finished: bool, logprobs: Any = None) -> bool:
        """One output's new tokens (and, when asked, each one's logprobs: a dict of
        token id to vLLM's ``Logprob``), under the lock; True once it is terminal."""
        if req.phase.terminal:
            return True
        self.tick += 1
        now = time.monotonic_ns()
        for i, token in enumerate(tokens):
            if req.notes is not None and logprobs is not None and not self.vocab.is_eog(token):
                req.notes.next = line(token, entry(token, logprobs[i], req.notes.top),
                                      self.vocab.piece, self.vocab.piece(token))
            if self._accept(req, token, now):
                return True
        if finished:
            if reason == "error":  # vLLM's own failure: the output is cut, not whole
                return self._end_if_running(req, Phase.FAILED, failure=Failure.DECODE)
            if reason == "abort":
                return self._end_if_running(req, Phase.CANCELLED)
            length = reason == "length" or req.sampled >= req.max_tokens
            return self._end_if_running(req, Phase.COMPLETED,
                                        Finish.LENGTH if length else Finish.STOP)
        return False

    def _accept(self, req: Request, token: int, now: int) -> bool:
        """The shared rule (accept.py); True when the token ends the request."""
        if not req.first_token_ns and req in self.queue:
            self.queue.remove(req)
            self.active.append(req)
        eog = self.vocab.is_eog(token)
        ending = accept(req, token, b"" if eog else self.vocab.piece(token), now, self.stats,
                        eog=eog, held=len(req.prompt) + req.sampled + 1,
                        context=self.vocab.slot_context)
        return ending is not None and self._end_if_running(req, *ending)

    def _end_if_running(self, req: Request, phase: Phase, finish: Finish = Finish.NONE,
                        failure: Failure = Failure.NONE) -> bool:
        if not req.phase.terminal:
            self._drop(req)
            self._finish(req, phase, finish, failure)
        return True

    def _drop(self, req: Request) -> None:
        if req in self.queue:
            self.queue.remove(req)
        elif req in self.active:
            self.active.remove(req)

    def _finish(self, req: Request, phase: Phase, finish: Finish = Finish.NONE,
                failure: Failure = Failure.NONE) -> None:
        settle(req, phase, finish, failure)
        req.segments = []  # its decoded media (vLLM has its own copy)
        if not req.background:
            self.stats.finished[phase.name.lower()] += 1
        self.on_terminal(req)


def unsupported(sampling: Any) -> EngineFeature | None:
    """What a submission asks that this engine does not do (the device refuses it):
    vLLM's penalties count every token generated, with no window."""
    if sampling.last_n:
        return EngineFeature.PENALTY_WINDOW
    return None


def entry(token: int, ranked: dict[int, Any], top: int) -> Entry:
    """vLLM's logprobs of one position (the sampled token and the ``top`` likeliest) as
    engine/logprobs.py's entry: the chosen token's, and the alternatives likeliest first
    (ties by token id).  As on llama.cpp, an alternative the grammar's mask ruled out
    (vLLM masks the logits first, so its logprob is -inf) is no alternative."""
    alts = sorted(((t, float(p.logprob)) for t, p in ranked.items()
                   if p.rank is not None and p.rank <= top and math.isfinite(p.logprob)),
                  key=lambda a: (-a[1], a[0]))
    return float(ranked[token].logprob), alts[:top]


def sampling_params(req: Request) -> Any:
    """vLLM's ``SamplingParams`` for ``req``: new token ids only, as they come (aotx
    makes the text), the request's seed, its sampler and its length."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    spec = req.matcher.spec if req.matcher is not None else None
    return SamplingParams(
        n=1, temperature=req.temperature, top_p=req.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence, frequency_penalty=s.frequency,
        repetition_penalty=s.repetition, seed=req.seed, max_tokens=req.max_tokens,
        logit_bias=dict(s.bias) or None, detokenize=False, skip_special_tokens=False,
        logprobs=s.logprobs - 1 if s.logprobs else None,
        structured_outputs=structured_outputs(spec) if spec is not None else None,
        output_kind=RequestOutputKind.DELTA)


def structured_outputs(spec: GrammarSpec) -> Any:
    """The constraint aotx compiled (and so checked) for this vocabulary, as vLLM's
    guidance backend takes it: a JSON schema with the JSON layout aotx fixes
    (``JSON_OPTIONS``, as llguidance's ``x-guidance``), a Lark grammar, a regex."""
    from vllm.sampling_params import StructuredOutputsParams

    if spec.kind == "json_schema":
        schema = json.loads(spec.source)
        schema = {} if schema is True else schema  # (false is refused when compiled)
        return StructuredOutputsParams(json={**schema, "x-guidance": JSON_OPTIONS})
    if spec.kind == "lark":
        return StructuredOutputsParams(grammar=spec.source)
    return StructuredOutputsParams(regex=spec.source)


def lora_request(alias: str, number: int, path: str) -> Any:
    """vLLM's ``LoRARequest`` for an adapter served as ``alias`` (``number``: its id)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=alias, lora_int_id=number, lora_path=path)
