"""The engines' contract.

What the device holds of a loaded model, whichever engine runs it: the model
(:class:`Model`: its vocabulary, sizes and lifecycle) and the engine thread that runs its
requests (:class:`Runner`: llama.cpp's ``Scheduler``, vLLM's ``VllmRunner``), which counts
the same figures (:class:`EngineStats`) and accepts a sampled token by the same rule
(:func:`aotx.engine.accept.accept`).  The device imports these, never an engine kind.

Below them, what the llama.cpp scheduler needs from its engine (:class:`Engine`) and from
the engine thread's other work (:class:`Side`), and what a step reports
(:class:`StepOutcome`)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..wire import EngineFeature, Sampling
from .histogram import Histogram
from .request import Request

if TYPE_CHECKING:
    from .grammar import GrammarCompiler


class EngineError(Exception):
    """An engine could not load, or could not do what it was asked (either kind)."""


@dataclass(slots=True)
class BatchEntry:
    """One token of a llama.cpp batch: what the scheduler hands ``Engine.decode``."""

    token: int
    pos: int
    seq: int
    logits: bool


@dataclass
class EngineStats:
    """What an engine thread counts, either kind: the device's /metrics per model."""

    prompt_tokens_in: int = 0  # prompt tokens evaluated (llama.cpp) or sent (vLLM)
    tokens_out: int = 0  # tokens sampled, end of generation included
    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    ttft: Histogram = field(default_factory=Histogram)  # seconds to a request's first token
    itl: Histogram = field(default_factory=Histogram)  # seconds between two of its tokens


class Model(Protocol):
    """A loaded model as the device uses it: its vocabulary (tokenizing at admission,
    checking token ids), its sizes (INFO, telemetry) and its end."""

    slot_context: int  # tokens a sequence holds
    n_vocab: int
    add_bos: bool
    special_ids: frozenset[int]
    kv_cells: int
    model_bytes: int
    threads: int
    closes_slowly: bool  # close() waits on another process: the device closes it aside
    applies_grammar: bool  # the engine applies a request's grammar itself (its masks)

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True,
                        start: bool = True, end: bool = True) -> list[int]: ...
    def specials(self, text: str) -> list[int]: ...
    def rank_prompt(self, query: str, document: str) -> list[int]: ...  # a reranker's input
    def token_text(self, token: int) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...  # a special token's text included
    def metadata(self, key: str) -> str | None: ...
    def grammar_compiler(self) -> GrammarCompiler: ...
    def kv_bytes(self) -> int: ...
    def close(self) -> None: ...


class Runner(Protocol):
    """A model's engine thread as the device drives it.  ``submit``, ``cancel`` and the
    figures are called with the device lock held; ``run`` is the thread; ``stop`` ends it."""

    active: list[Request]  # requests producing tokens
    tick: int  # steps taken (llama.cpp) or outputs applied (vLLM)
    stats: EngineStats
    on_fatal: Callable[[str], None]  # the engine cannot serve any more: restart the device

    @property
    def queue(self) -> Collection[Request]:
        """Requests waiting for a sequence (or, on vLLM, for their first token)."""

    def submit(self, req: Request) -> None: ...
    def cancel(self, req: Request) -> None: ...
    def run(self) -> None: ...
    def stop(self) -> None: ...
    def warm(self, prefix: list[int]) -> None: ...
    def unsupported(self, sampling: Sampling) -> EngineFeature | None: ...
    def add_adapter(self, role: int, alias: str, path: str) -> None: ...
    def engine_metrics(self) -> dict[str, object]: ...


@dataclass
class StepOutcome:
    """What one :meth:`Scheduler.step` did: the engine thread's report."""

    ran: bool = False  # False: there was nothing to do
    tokens: int = 0  # batch entries decoded (prompt and sampled positions)
    sampled: int = 0  # tokens sampled
    media: bool = False  # a media segment was encoded and decoded
    ended: list[Request] = field(default_factory=list)  # requests that became terminal

    def __bool__(self) -> bool:
        return self.ran


class Side(Protocol):
    """Other work of the engine thread, one bounded piece after each step (embeddings:
    engine/embedding.py): ``pending`` with the lock held, ``step`` takes it itself;
    ``busy``: requests are being decoded, so the piece should be a small one."""

    def pending(self) -> bool: ...
    def step(self, busy: bool) -> None: ...


class Engine(Protocol):
    slot_context: int
    kv_cells: int

    def decode(self, entries: list[BatchEntry]) -> int: ...
    def sample(self, sampler: Any, index: int, mask: Any = None) -> int: ...
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def clear_sequence(self, seq: int) -> None: ...
    def decode_embeddings(self, embd: Any, n_tokens: int, pos: int, seq: int,
                          non_causal: bool = False) -> int: ...
    def trim_sequence(self, seq: int, keep: int) -> bool: ...
    def copy_sequence(self, src: int, dst: int) -> None: ...
    def save_sequence(self, seq: int) -> bytearray: ...
    def restore_sequence(self, seq: int, data: bytearray) -> bool: ...
    def logits_rows(self, indices: list[int]) -> Any: ...
    def kv_bytes(self) -> int: ...
    def thread_figures(self) -> tuple[int, int]: ...  # threads now, changes (cores.py)
