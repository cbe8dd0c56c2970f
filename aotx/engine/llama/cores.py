"""How many ggml threads a decode runs on: every core of the engine's, less one for each
core that another process keeps busy.

ggml splits each graph node across its threads and meets them at a barrier after every
node.  When a core is shared with another busy process, the thread on it is descheduled
for whole scheduler slices while its peers spin at the barrier: on 2 cores beside
``python -c 'while 1: pass'`` a 32-token answer took 18-79 s with two threads and 0.5 s
with one (bench/bench_contention.py; docs/performance.md, "Beside another busy
process").  llama-server has the same cliff; its ``-t`` is fixed.

:class:`FreeCores` samples, at most every :data:`PERIOD` seconds while the engine
decodes, the CPU time spent on the engine's cores (``/proc/stat``, the lines of the CPUs
in its affinity) and the CPU time of its own process (``os.times``); the difference is
what other processes used.  :func:`fit` turns that into a thread count, with a gap
between the figure that lowers it and the one that raises it again, so that a process
near the threshold does not flip the count at every sample.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds between samples (and the shortest window a decision is made on).
PERIOD = 0.5
#: A window longer than this (the engine was idle) is not averaged over: it starts again.
STALE = 2.0
#: Another process's average share of a core above which it takes a thread's core ...
LOWER_ABOVE = 0.5
#: ... and below which a thread it took is given back.
RAISE_BELOW = 0.25


@dataclass(frozen=True)
class Sample:
    wall: float  # seconds, monotonic
    busy: float  # CPU seconds, every process, on the engine's cores
    own: float  # CPU seconds of this process (every thread)


def fit(current: int, most: int, cores: int, others: float) -> int:
    """The thread count after a window in which other processes kept ``others`` cores
    busy on average: one thread fewer than ``cores`` for each core they used more than
    :data:`LOWER_ABOVE` of, raised again only once they use less than :data:`RAISE_BELOW`
    of it; between the two, ``current``.  Never below 1 or above ``most``."""
    def taken(margin: float) -> int:
        return max(0, math.ceil(others - margin))

    lower = max(1, min(most, cores - taken(LOWER_ABOVE)))
    if lower < current:
        return lower
    higher = max(1, min(most, cores - taken(RAISE_BELOW)))
    return max(higher, current)


def _cpu_lines(cpus: frozenset[int]) -> Callable[[], float]:
    tick = float(os.sysconf("SC_CLK_TCK"))
    names = {f"cpu{c}" for c in cpus}

    def busy() -> float:
        total = 0
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                fields = line.split()
                if fields[0].decode() in names:
                    # user nice system idle iowait irq softirq steal: all but idle and iowait
                    # (steal is time the hypervisor gave to another guest)
                    total += sum(int(v) for v in fields[1:9]) - int(fields[4]) - int(fields[5])
        return total / tick
    return busy


def read_sample(busy: Callable[[], float]) -> Sample:
    t = os.times()
    return Sample(time.monotonic(), busy(), t.user + t.system)


class FreeCores:
    """The thread count for the next decode (:meth:`threads`), between 1 and ``most``."""

    def __init__(self, most: int, cpus: frozenset[int] | None = None,
                 read: Callable[[], Sample] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.cores = len(cpus)
        self.most = most
        self.current = most
        self.changes = 0
        self.others = 0.0  # the last window's figure (for the log and tests)
        if read is None:
            busy = _cpu_lines(cpus)
            read = lambda: read_sample(busy)  # noqa: E731
        self._read, self._clock = read, clock
        self._last: Sample | None = None

    def threads(self) -> int:
        """Called before a decode: samples when :data:`PERIOD` has passed, and returns the
        count to decode with."""
        if self.most <= 1:
            return self.most
        last = self._last
        if last is not None and self._clock() - last.wall < PERIOD:
            return self.current
        now = self._read()
        self._last = now
        if last is None or not PERIOD <= now.wall - last.wall <= STALE:
            return self.current  # the first sample, or one after an idle stretch
        wall = now.wall - last.wall
        self.others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / wall
        want = fit(self.current, self.most, self.cores, self.others)
        if want != self.current:
            self.current = want
            self.changes += 1
        return self.current
