"""The KV pool: one llama.cpp KV cache of ``cells`` cells that every sequence of a model
shares (``kv_unified``), sized by a budget in bytes rather than slots x context.

A sequence takes cells as it grows.  The scheduler keeps the pool from overflowing in
three ways, cheapest first:

1. **Queue.**  A new request starts only when its prompt fits beside what the running
   sequences hold, with :data:`GROWTH` cells of room for each of them (:meth:`room`).
2. **Evict cached prefixes.**  A finished request's cells stay in its sequence for the
   next request that shares its prefix (prompt caching); under pressure they are given
   back, least recently used first.
3. **Preempt.**  When a decode finds no cells (llama_decode returns 1, before anything
   is computed), the lowest-priority running request (background work first, then the
   one admitted last) gives its cells back and waits at the head of its queue; when it
   starts again it evaluates its prompt and the tokens it had generated (recompute, as
   vLLM does) and goes on sampling where it stopped: the sampler, grammar matcher and
   output buffer are kept, so it completes with the bytes it would have written.

The counts are an upper bound: a prefix copied between sequences shares its cells.
Sans-I/O: the scheduler does the engine calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

#: Cells kept free per running sequence when a new request starts, so that the running
#: ones can grow for a while before anyone is preempted (at least 1: the step's own
#: token, else a preempted request could start again at once and fail the same step).
GROWTH = 32
H = TypeVar("H", bound="Held")


class Held(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def n_past(self) -> int: ...
    @property
    def background(self) -> bool: ...
    @property
    def segments(self) -> Sequence[object]: ...
    @property
    def prefill(self) -> Sequence[int]: ...


class KvPool:
    def __init__(self, cells: int, shared: bool = True) -> None:
        self.cells = cells
        self.shared = shared  # False: a stream per sequence, which never overflows
        self.preemptions = 0  # running requests that gave their cells back
        self.evictions = 0  # cached prefixes given back
        self.freed_at: dict[int, int] = {}  # sequence -> the step its last request ended
        self.ended = 0  # requests that ended (their cells came free)

    def in_use(self, active: Iterable[Held], cached: dict[int, list[int]],
               free_seqs: Iterable[int]) -> int:
        """Cells held: the active requests' tokens (their whole prefill: a prompt still
        being evaluated will hold its cells) and the free sequences' cached prefixes."""
        return (sum(max(r.n_past, len(r.prefill)) for r in active if r.seq >= 0)
                + sum(len(cached.get(q, ())) for q in free_seqs))

    def room(self, need: int, running: int, used: int) -> bool:
        """Whether ``need`` cells (a prompt) fit beside ``used``, with room to grow for the
        ``running`` sequences and the new one."""
        return used + need + GROWTH * (running + 1) <= self.cells

    def evictable(self, cached: dict[int, list[int]], free_seqs: Iterable[int]) -> list[int]:
        """Free sequences holding cells, least recently used first."""
        held = [q for q in free_seqs if cached.get(q)]
        return sorted(held, key=lambda q: self.freed_at.get(q, -1))

    def victim(self, active: Sequence[H]) -> H | None:
        """The request to preempt, or None when there is none to spare: background work
        first, then the one admitted last.  Never the only one, never one with media
        (its segments would have to be encoded again)."""
        if len(active) < 2:
            return None
        candidates = [r for r in active if r.seq >= 0 and not r.segments]
        background = [r for r in candidates if r.background]
        pool = background or candidates
        return pool[-1] if pool else None
