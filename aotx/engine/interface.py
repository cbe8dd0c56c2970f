"""What the scheduler needs from an engine (:class:`Engine`, llama.cpp's in llama.py)
and from the engine thread's other work (:class:`Side`), and what a step reports
(:class:`StepOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .request import Request


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
