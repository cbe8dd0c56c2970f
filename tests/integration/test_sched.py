"""Short scheduler slices for the latency-sensitive threads (aotx.cpuslice)."""

from __future__ import annotations

import os
import threading

import pytest

from aotx.config import Settings
from aotx.cpuslice import SHORT_SLICE_NS, request_short_slice


def slice_of(pid: int, tid: int | None = None) -> int | None:
    """The thread's EEVDF slice in ns from /proc (None on kernels without it)."""
    path = f"/proc/{pid}/task/{tid or pid}/sched"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except OSError:
        return None
    return None


def in_new_thread(fn):  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}

    def run() -> None:
        out["ok"] = fn()
        out["slice"] = slice_of(os.getpid(), threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["ok"], out["slice"]


def short_slices_supported() -> bool:
    ok, got = in_new_thread(request_short_slice)
    return bool(ok) and got == SHORT_SLICE_NS


def test_request_short_slice_sets_the_calling_thread_only(monkeypatch) -> None:
    before = slice_of(os.getpid(), threading.get_native_id())
    ok, got = in_new_thread(request_short_slice)
    if not ok or got is None or got != SHORT_SLICE_NS:
        pytest.skip(f"this kernel ({os.uname().release}) has no per-thread slices")
    assert slice_of(os.getpid(), threading.get_native_id()) == before != SHORT_SLICE_NS
    # AOTX_SHORT_SLICE=0, as aotx.config reads it, turns it off
    monkeypatch.setenv("AOTX_SHORT_SLICE", "0")
    enabled = Settings.from_env().short_slice
    ok, got = in_new_thread(lambda: request_short_slice(enabled))
    assert ok is False and got == before
