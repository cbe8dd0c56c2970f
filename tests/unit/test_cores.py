"""The engine's thread count beside other busy processes (engine/llama/cores.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from aotx.engine.llama.cores import PERIOD, STALE, FreeCores, Sample, _cpu_lines, fit, read_sample


def test_a_busy_core_takes_a_thread_and_gives_it_back_only_when_quiet() -> None:
    assert fit(2, 2, 2, 0.05) == 2
    assert fit(2, 2, 2, 0.67) == 1  # a hog beside two spinning threads gets 2/3 of a core
    assert fit(1, 2, 2, 1.0) == 1
    assert fit(1, 2, 2, 0.4) == 1  # between the two thresholds: held
    assert fit(2, 2, 2, 0.4) == 2
    assert fit(1, 2, 2, 0.1) == 2
    assert fit(1, 2, 2, 3.0) == 1  # never below one
    assert fit(8, 8, 8, 2.7) == 5  # one a busy core, rounded up past the margin
    assert fit(5, 8, 8, 2.3) == 5  # the third core still over RAISE_BELOW busy: held
    assert fit(5, 8, 8, 2.2) == 6
    assert fit(4, 4, 16, 6.0) == 4  # more cores than threads: the bound is the count


class Script:
    """Samples of a scripted machine: ``others`` cores busy besides this process."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.others, self.reads = 0.0, 0.0, 0.0, 0.0, 0

    def advance(self, seconds: float, own_cores: float = 1.0) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + self.others) * seconds

    def read(self) -> Sample:
        self.reads += 1
        return Sample(self.now, self.busy, self.own)


def test_free_cores_follows_another_process() -> None:
    m = Script()
    cores = FreeCores(2, frozenset({0, 1}), read=m.read, clock=lambda: m.now)
    assert cores.threads() == 2 and m.reads == 1
    m.others = 1.0
    m.advance(PERIOD / 2)
    assert cores.threads() == 2 and m.reads == 1  # within the period: no sample
    m.advance(PERIOD / 2)
    assert cores.threads() == 1 and cores.changes == 1
    assert cores.others == pytest.approx(1.0)
    m.advance(PERIOD)
    assert cores.threads() == 1  # held while the other process runs
    m.others = 0.05
    m.advance(PERIOD)
    assert cores.threads() == 2 and cores.changes == 2


def test_an_idle_stretch_is_not_averaged_over() -> None:
    m = Script()
    cores = FreeCores(2, frozenset({0, 1}), read=m.read, clock=lambda: m.now)
    cores.threads()
    m.others = 1.0
    m.advance(STALE * 3, own_cores=0.0)  # the engine was idle while the other ran
    assert cores.threads() == 2 and cores.changes == 0  # a new window starts
    m.advance(PERIOD)
    assert cores.threads() == 1


def test_one_thread_is_never_sampled() -> None:
    m = Script()
    cores = FreeCores(1, frozenset({0, 1}), read=m.read, clock=lambda: m.now)
    m.advance(PERIOD)
    assert cores.threads() == 1 and m.reads == 0


def test_the_machine_sample_sees_a_busy_process() -> None:
    """The real reader: /proc/stat's lines of this process's CPUs less its own time."""
    cpus = frozenset(os.sched_getaffinity(0))
    busy = _cpu_lines(cpus)
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.3)
        a = read_sample(busy)
        time.sleep(1.0)
        b = read_sample(busy)
    finally:
        hog.kill()
        hog.wait()
    others = ((b.busy - a.busy) - (b.own - a.own)) / (b.wall - a.wall)
    assert others >= 0.6  # the hog's core (less what the scheduler gave to others)
    assert b.own - a.own < 0.3  # this process slept
