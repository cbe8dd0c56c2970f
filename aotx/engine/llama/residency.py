"""KV memory committed as it is used, not when the context is created.

llama.cpp allocates a context's KV cache in one buffer and clears it with ``memset``
(``llama_kv_cache``'s constructor), which makes every page of it resident at once: a
stream of 4096 cells for each of 16 sequences holds 1.4 GiB of a small model's memory
before the first request.  A page of zeros and a page the kernel has never backed read
the same, so the pages of that buffer that are still all zeros are handed back with
``madvise(MADV_DONTNEED)`` right after the context is created.  The kernel backs a page
again when a decode writes a cell in it; reading an unbacked page (attention over cells
not written yet) maps the shared zero page and costs no memory.  Resident KV then grows
with the cells the sequences have written, to at most the whole reservation.

Only private anonymous memory mapped while the context was created (a new mapping the
kernel merged with an older one counts for its new part alone), and only whole pages of
zeros, are released: for any owner of such a page that is no change of
content, unless another thread writes it between the scan and the ``madvise``.  The
device creates its llama.cpp contexts first, before it starts any thread or a vLLM
engine (``aotx.device.runtime``).

Handed back only after the context exists, the whole buffer would still be resident
for the moment between (1.6 GB at the defaults: the machine would need the whole
reservation free at start).  So while llama.cpp creates the context, a thread
(:class:`ReleasingWhile`) hands back, every few milliseconds, the pages the clear has
made resident (``mincore``) and that hold zeros, in the KV buffer's own mapping only:
a new mapping of the buffer's size, give or take its allocator's header.  Its only
writer then is the clear, which writes zeros, so a page it writes again after its
release reads the same.  Other large allocations made meanwhile (the scheduler's
tables, filled right after they are zeroed) are left to the pass after creation; so
is a KV mapping the kernel merged with another new one (its size is not the buffer's).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TypeVar

import numpy as np

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # Linux
#: Pages scanned at a time (64 MiB): the zero test's temporary stays small.
CHUNK_PAGES = (64 << 20) // PAGE

Region = tuple[int, int]  # [start, end) of a mapping
#: How much larger than the KV bytes its mapping may be: the allocator's header and
#: alignment, and the tensors' padding to ggml's alignment.
KV_SLACK = 1 << 20
T = TypeVar("T")


def create_uncommitted(create: Callable[[], T], kv_bytes: int,
                       alone: bool = True) -> tuple[T, int]:
    """``create()`` (a llama.cpp context whose KV buffer is ``kv_bytes``), with the zero
    pages of its KV buffer handed back as the clear goes, and those of the new mappings of
    at least half that size once it has returned; and the bytes released (a page the
    clear wrote again after its release counts again).  ``alone``: no other thread of
    this process runs (at start); a model loaded while others serve (on demand) has only
    its KV buffer's mapping scanned after creation too."""
    with ReleasingWhile(kv_bytes, kv_bytes + KV_SLACK) as early:
        made = create()
    assert early.before is not None
    regions = new_regions(early.before, anonymous_mappings())
    if not alone:  # other threads run: the KV buffer's own mapping only, as while creating
        regions = {r for r in regions if kv_bytes <= r[1] - r[0] <= kv_bytes + KV_SLACK}
    return made, early.released + release_zero_pages(regions, kv_bytes // 2)


def available_bytes() -> int:
    """MemAvailable (/proc/meminfo), or 8 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


def anonymous_mappings() -> set[Region]:
    """This process's private, writable, anonymous mappings (none where there is no
    ``/proc/self/maps``)."""
    found: set[Region] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 5 and fields[1] == "rw-p" and fields[4] == "0":
                    start, end = fields[0].split("-")
                    found.add((int(start, 16), int(end, 16)))
    except OSError:
        pass
    return found


def new_regions(before: set[Region], after: set[Region]) -> set[Region]:
    """The address ranges mapped in ``after`` that were not in ``before``: a new mapping
    the kernel merged with an older neighbour counts only for its new part."""
    old = sorted(before)
    out: set[Region] = set()
    for start, end in after - before:
        at = start
        for lo, hi in old:
            if hi <= at or lo >= end:
                continue
            if lo > at:
                out.add((at, lo))
            at = max(at, hi)
        if at < end:
            out.add((at, end))
    return out


def release_zero_pages(regions: set[Region], min_bytes: int) -> int:
    """Hand back the all-zero pages of each region of at least ``min_bytes``; returns the
    bytes released."""
    libc = _libc()
    if libc is None:
        return 0
    return sum(_release_chunk(libc, at, pages) for at, pages in _chunks(regions, min_bytes))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc with ``madvise`` and ``mincore`` typed, loaded once (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _chunks(regions: set[Region], min_bytes: int) -> Iterator[tuple[int, int]]:
    """(address, pages) of each scan chunk of the regions of at least ``min_bytes``."""
    for start, end in sorted(regions):
        if end - start >= min_bytes:
            for at in range(start, end, CHUNK_PAGES * PAGE):
                yield at, min(CHUNK_PAGES, (end - at) // PAGE)


def _release_chunk(libc: ctypes.CDLL, at: int, pages: int) -> int:
    words = (ctypes.c_uint64 * (pages * PAGE // 8)).from_address(at)
    zero = ~np.ctypeslib.as_array(words).reshape(pages, PAGE // 8).any(axis=1)
    # the runs of zero pages: where ``zero`` turns on and off
    edges = np.flatnonzero(np.diff(np.concatenate(([0], zero.view(np.int8), [0]))))
    released = 0
    for first, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        if libc.madvise(at + first * PAGE, (stop - first) * PAGE, MADV_DONTNEED) == 0:
            released += (stop - first) * PAGE
    return released


def release_resident_zero_pages(regions: set[Region], min_bytes: int) -> int:
    """As :func:`release_zero_pages`, but only the pages that are resident (``mincore``):
    a pass costs a bit a page, not a read of every page."""
    libc = _libc()
    if libc is None:
        return 0
    return sum(_release_resident(libc, at, pages) for at, pages in _chunks(regions, min_bytes))


def _release_resident(libc: ctypes.CDLL, at: int, pages: int) -> int:
    vec = np.zeros(pages, np.uint8)
    if libc.mincore(at, pages * PAGE, vec.ctypes.data) != 0:
        return 0  # unmapped meanwhile: nothing of ours
    resident = np.flatnonzero(vec & 1)
    if resident.size == 0:
        return 0
    # the resident runs, each released where it holds zeros
    breaks = np.flatnonzero(np.diff(resident) != 1) + 1
    return sum(_release_chunk(libc, at + int(run[0]) * PAGE, int(run[-1]) + 1 - int(run[0]))
               for run in np.split(resident, breaks))


class ReleasingWhile:
    """``with ReleasingWhile(low, high): create_the_context()``: a thread hands back the
    resident zero pages of each mapping new since the block began whose size is from
    ``low`` to ``high`` bytes, every ``interval`` seconds, until the block ends (the
    module's docstring says why only those)."""

    def __init__(self, low: int, high: int, interval: float = 0.002) -> None:
        self.low, self.high, self.interval = low, high, interval
        self.before: set[Region] | None = None  # taken once the thread (its stack) exists
        self.released = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-release", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.before is None:
                continue
            # not a mapping's first page: the allocator writes its header there at once
            sized = {(lo + PAGE, hi) for lo, hi in new_regions(self.before, anonymous_mappings())
                     if self.low <= hi - lo <= self.high}
            self.released += release_resident_zero_pages(sized, 0)

    def __enter__(self) -> ReleasingWhile:
        self._thread.start()
        self.before = anonymous_mappings()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
