"""A request as the engine sees it: what it asks, where it stands, what it wrote.  The
device creates it and reads it under the lock; the engine thread owns its engine state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..wire import Finish, Phase, Sampling
from .grammar import Matcher
from .logprobs import Annotations
from .multimodal import MediaSegment
from .output import OutputBuffer


class Failure(enum.Enum):
    """Why the engine failed a request (the device decides what status that is)."""

    NONE = enum.auto()
    NO_MEMORY = enum.auto()  # llama_decode found no KV cells for the batch (it returned 1)
    DECODE = enum.auto()  # llama_decode failed otherwise
    MEDIA = enum.auto()  # the projector could not encode a media segment
    GRAMMAR = enum.auto()  # the request's grammar matcher failed (a step limit of llguidance)
    REFUSED = enum.auto()  # its admission, deferred while its model loaded, refused it



@dataclass(eq=False)
class Request:
    identity: bytes
    principal: int
    revision: int
    role: int
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stops: tuple[bytes, ...] = ()
    sampling: Sampling = Sampling()  # top-k, min-p, penalties, logit bias
    phase: Phase = Phase.QUEUED
    cancel_requested: bool = False
    finish: Finish = Finish.NONE
    stop_hit: int = 0  # the stop string it ended on: its index + 1 (0: none)
    # A thinking model's (engine/accept.py count_thinking): where the output is (THINK_*),
    # the bytes it looks at, and the tokens sampled from <think> to </think>
    think: int = 2
    think_tags: tuple[bytes, ...] = (b"<think>", b"</think>")  # (open, close, other closes)
    think_tail: bytes = b""
    reasoning_tokens: int = 0
    failure: Failure = Failure.NONE
    out: bytearray = field(default_factory=bytearray)
    sampled: int = 0
    created_ns: int = field(default_factory=time.monotonic_ns)
    first_token_ns: int = 0
    last_token_ns: int = 0
    generated: list[int] = field(default_factory=list)  # sampled tokens fed back to the model
    prefill: list[int] = field(default_factory=list)  # tokens to evaluate: the prompt (and,
    # after a preemption, the tokens generated: kvpool.py)
    preemptions: int = 0  # times it gave its KV cells back
    resume_after: int = 0  # a preempted request starts again once this many have ended
    reused_tokens: int = 0  # prompt tokens found in the sequence's KV cache
    media: list[bytes] = field(default_factory=list)  # leased media sources, in prompt order
    finished_ns: int = 0
    memory_off: bool = False
    kept_flags: int = 0  # SUBMIT flags the state replies carry back (SUBMIT_FLAG_TOOLS)
    background: bool = False  # resident-policy work: yields to any foreground request
    preempted: bool = False  # a background request cancelled because foreground work came
    source_text: str = ""  # the conversation, kept only when it may become a memory source
    segments: list[MediaSegment] = field(default_factory=list)  # image/audio spans of prompt
    next_segment: int = 0  # index of the first segment not yet decoded
    # engine state, owned by the engine thread
    seq: int = -1
    n_past: int = 0
    next_token: int = -1
    sampler: object = None
    buffer: OutputBuffer | None = None
    # Constrained decoding: the request's own matcher (grammar.GrammarCompiler.compile(
    # spec).matcher()), set before submit; the engine thread owns it from then on.
    matcher: Matcher | None = None
    notes: Annotations | None = None  # logprobs asked (sampling.logprobs): logprobs.py
    refused: tuple[int, int] = (0, 0)  # Failure.REFUSED: the refusal's status and reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


def settle(req: Request, phase: Phase, finish: Finish, failure: Failure) -> None:
    """Make ``req`` terminal, as every engine does: the bytes its output buffer held back
    (not for a failure), the end of its annotation stream, its terminal fields."""
    if req.buffer is not None and phase is not Phase.FAILED:
        req.out += req.buffer.flush()
    if req.notes is not None:
        req.notes.end(len(req.out))
    req.phase, req.finish, req.failure = phase, finish, failure
    req.finished_ns = time.monotonic_ns()
