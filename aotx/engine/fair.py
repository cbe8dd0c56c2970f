"""Fair sharing between principals: the queue of one scheduler, and whose prompt cache
a request may reuse.

The queue is one FIFO per principal.  When a sequence (slot) frees, the next request
comes from the principal with the fewest requests running now, the oldest waiting
request breaking ties (max-min fairness on slots, the policy of per-tenant fair
schedulers): a principal with nothing running is served at the first free slot,
however many requests another principal has queued, and principals with equal shares
take turns in arrival order.  Policy work (``background``) comes last.

A sequence's cached tokens are reusable by another request only up to what it may
see: everything when the request's principal computed them, otherwise only the
*public prefix* (the chat template's fixed start, the same for everybody by
construction).  So a prompt's cost never tells one principal what another sent
(the cache-timing attack that vLLM answered with a cache salt, CVE-2025-46570).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    principal: int
    background: bool
    created_ns: int


R = TypeVar("R", bound=Queued)

#: The owner of cells that hold only the public prefix, or policy work's (nobody's).
NOBODY = -1


def owner_of(req: Queued) -> int:
    """Whose cached tokens a finished request leaves behind."""
    return NOBODY if req.background else req.principal


class FairQueue(Generic[R]):
    """Queued requests, one FIFO per principal (``len`` and iteration as a deque's)."""

    def __init__(self) -> None:
        self._fifos: dict[int, collections.deque[R]] = {}
        self._count = 0
        self._started = 0  # requests popped so far
        self._last: dict[int, int] = {}  # principal -> when it last had a request popped

    def append(self, req: R) -> None:
        self._fifos.setdefault(owner_of(req), collections.deque()).append(req)
        self._count += 1

    def push_front(self, req: R) -> None:
        """Put back a request just popped (it waits one more step), ahead of its FIFO."""
        self._fifos.setdefault(owner_of(req), collections.deque()).appendleft(req)
        self._count += 1

    def remove(self, req: R) -> None:
        key = owner_of(req)
        fifo = self._fifos[key]
        fifo.remove(req)
        self._count -= 1
        if not fifo:
            del self._fifos[key]

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[R]:
        for fifo in list(self._fifos.values()):
            yield from fifo

    def __contains__(self, req: object) -> bool:
        return any(req in fifo for fifo in self._fifos.values())

    def pop_next(self, running: collections.Counter[int]) -> R:
        """The next request to start: the head of the FIFO whose principal has the fewest
        requests in ``running`` (principal -> count), then the one served least recently
        (principals take turns), then the oldest head."""
        key = min(self._fifos, key=lambda k: (k == NOBODY, running[k], self._last.get(k, -1),
                                              self._fifos[k][0].created_ns))
        self._started += 1
        self._last[key] = self._started
        fifo = self._fifos[key]
        req = fifo.popleft()
        self._count -= 1
        if not fifo:
            del self._fifos[key]
            del self._last[key]  # an idle principal starts afresh (no unbounded table)
        return req


def usable_prefix(cached: list[int], owner: int, prompt: list[int], principal: int,
                  public: list[int]) -> int:
    """How many of ``cached`` (computed for ``owner``) a request of ``principal`` whose
    prompt is ``prompt`` may reuse: the common prefix, cut to the public prefix unless
    the cells are the principal's own."""
    n = common_prefix(cached, prompt)
    if owner != principal:
        n = min(n, common_prefix(public, prompt))
    return n


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix, by halving with slice comparisons (each
    done in C): every start compares the prompt with every free sequence and every
    spilled conversation, thousands of tokens each, under the device lock."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
