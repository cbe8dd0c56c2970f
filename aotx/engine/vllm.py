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

:class:`VllmRunner` stands where :class:`~aotx.engine.scheduler.Scheduler` stands for
llama.cpp: the control thread calls ``submit`` and ``cancel`` with the device lock
held; the engine thread runs an asyncio loop (``run``) with one task per request,
and applies each output under the lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ..wire import EngineFeature, Finish, Phase
from .hfvocab import HfVocab, from_hf
from .histogram import Histogram
from .llama import EngineError
from .output import OutputBuffer
from .request import Failure, Request

log = logging.getLogger("aotx.engine")


class EngineClient(Protocol):
    """The part of vLLM's ``vllm.engine.protocol.EngineClient`` aotx uses."""

    def generate(self, prompt: Any, sampling_params: Any, request_id: str
                 ) -> AsyncIterator[Any]: ...
    async def abort(self, request_id: str) -> None: ...
    async def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


ParamsFactory = Callable[[Request], Any]


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
        self.prompt_tokens_in = 0
        self.tokens_out = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.side = None  # no embedding work on this engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._tasks: dict[bytes, asyncio.Task[None]] = {}
        self._pending: list[Request] = []  # submitted before the loop runs

    @property
    def depth(self) -> int:
        return len(self.queue) + len(self.active)

    # -- called with the lock held (control thread) -------------------------
    def submit(self, req: Request) -> None:
        req.phase = Phase.QUEUED
        req.buffer = OutputBuffer(req.stops)
        self.queue.append(req)
        self.prompt_tokens_in += len(req.prompt)
        if self._loop is None:
            self._pending.append(req)
        else:
            self._loop.call_soon_threadsafe(self._start, req)

    def cancel(self, req: Request) -> None:
        if req.phase.terminal:
            return
        req.cancel_requested = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cancel, req)

    def engine_metrics(self) -> dict[str, object]:
        return {}

    # -- the engine thread --------------------------------------------------
    def run(self) -> None:
        """The engine thread: an asyncio loop with a task per request, until ``stop``."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        with self.lock:
            self._loop = loop
            for req in self._pending:
                loop.call_soon(self._start, req)
            self._pending.clear()
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks))
            loop.close()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    def _start(self, req: Request) -> None:
        if req.phase.terminal:
            return
        self._tasks[req.identity] = asyncio.get_running_loop().create_task(self._generate(req))

    def _cancel(self, req: Request) -> None:
        task = self._tasks.get(req.identity)
        if task is None:  # not started: it ends here
            with self.lock:
                if not req.phase.terminal:
                    self._drop(req)
                    self._finish(req, Phase.CANCELLED)
            return
        task.cancel()

    async def _generate(self, req: Request) -> None:
        rid = req.identity.hex()
        engine_done = False  # vLLM has ended the request itself
        try:
            stream = self.client.generate({"prompt_token_ids": list(req.prompt)},
                                          self.make_params(req), rid)
            async for out in stream:
                completion = out.outputs[0]
                engine_done = bool(out.finished)
                with self.lock:
                    ended = self._apply(req, list(completion.token_ids),
                                        completion.finish_reason, engine_done)
                self.on_step()  # the device answers the WAITs the new bytes satisfy
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
            self._tasks.pop(req.identity, None)
            self.on_step()
        if not engine_done:
            await self.client.abort(rid)  # aotx ended it first: vLLM's work stops too

    def _apply(self, req: Request, tokens: list[int], reason: str | None,
               finished: bool) -> bool:
        """One output's new tokens, under the lock; True once the request is terminal."""
        if req.phase.terminal:
            return True
        self.tick += 1
        now = time.monotonic_ns()
        for token in tokens:
            if self._accept(req, token, now):
                return True
        if finished:
            length = reason == "length" or req.sampled >= req.max_tokens
            return self._end_if_running(req, Phase.COMPLETED,
                                        Finish.LENGTH if length else Finish.STOP)
        return False

    def _accept(self, req: Request, token: int, now: int) -> bool:
        """As Scheduler._accept: count, time, publish; True when the token ends it."""
        req.sampled += 1
        self.tokens_out += 1
        if not req.first_token_ns:
            req.first_token_ns = now
            self.ttft.observe((now - req.created_ns) / 1e9)
            if req in self.queue:
                self.queue.remove(req)
                self.active.append(req)
        else:
            self.itl.observe((now - req.last_token_ns) / 1e9)
        req.last_token_ns = now
        if self.vocab.is_eog(token):
            return self._end_if_running(req, Phase.COMPLETED, Finish.STOP)
        req.generated.append(token)
        assert req.buffer is not None
        published, stopped = req.buffer.push(self.vocab.piece(token))
        req.out += published
        if stopped:
            return self._end_if_running(req, Phase.COMPLETED, Finish.STOP)
        if req.sampled >= req.max_tokens or (
                len(req.prompt) + req.sampled >= self.vocab.slot_context):
            return self._end_if_running(req, Phase.COMPLETED, Finish.LENGTH)
        if req.cancel_requested:
            return self._end_if_running(req, Phase.CANCELLED)
        req.phase = Phase.RUNNING
        return False

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
        if req.buffer is not None and phase is not Phase.FAILED:
            req.out += req.buffer.flush()
        req.phase, req.finish, req.failure = phase, finish, failure
        req.finished_ns = time.monotonic_ns()
        if not req.background:
            self.finished[phase.name.lower()] += 1
        self.on_terminal(req)


def unsupported(sampling: Any, constrained: bool) -> EngineFeature | None:
    """What a submission asks that this engine does not do yet (the device refuses it)."""
    if sampling.logprobs:
        return EngineFeature.LOGPROBS
    if sampling.last_n:
        return EngineFeature.PENALTY_WINDOW
    if constrained:
        return EngineFeature.CONSTRAINT
    return None


def sampling_params(req: Request) -> Any:
    """vLLM's ``SamplingParams`` for ``req``: new token ids only, as they come (aotx
    makes the text), the request's seed, its sampler and its length."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    return SamplingParams(
        n=1, temperature=req.temperature, top_p=req.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence, frequency_penalty=s.frequency,
        repetition_penalty=s.repetition, seed=req.seed, max_tokens=req.max_tokens,
        logit_bias=dict(s.bias) or None, detokenize=False, skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA)


class VllmModel(HfVocab):
    """A vLLM model as the device sees it: its vocabulary (hfvocab.py) and sizes.  Its
    KV cache is vLLM's, reported by vLLM's scheduler, not reserved here."""

    kv_cells = 0
    model_bytes = 0
    threads = 0

    def __init__(self, vocab: Any, context: int, client: EngineClient) -> None:
        super().__init__(vocab, context)
        self.client = client

    def kv_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.client.shutdown()


def start(path: str, settings: dict[str, Any]) -> VllmModel:
    """Start vLLM's ``AsyncLLM`` on the model folder ``path`` with the models file's
    settings; its engine core is a process of its own (spawned)."""
    try:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise EngineError("engine = \"vllm\" needs vLLM where the device runs: start "
                          "the service from a Python with vLLM (scripts/setup-vllm; "
                          f"docs/operations.md, \"Models served by vLLM\") ({exc})") from None
    client = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **settings))
    context = int(client.model_config.max_model_len)
    return VllmModel(from_hf(AutoTokenizer.from_pretrained(path)), context, client)
