"""The running service asks for short scheduler slices on its path threads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from aotx.engine.llama.cores import PERIOD

from ..helpers import Service
from ..integration.test_sched import SHORT_SLICE_NS, short_slices_supported, slice_of


def test_the_service_runs_its_path_threads_with_short_slices(service: Service) -> None:
    """Gateway, broker and the device's control thread ask for a short slice; the
    device's engine threads (the decode) keep the default one."""
    if not short_slices_supported():
        pytest.skip(f"this kernel ({os.uname().release}) has no per-thread slices")
    pids = service.children()
    assert slice_of(pids["gateway"]) == SHORT_SLICE_NS
    assert slice_of(pids["broker"]) == SHORT_SLICE_NS
    device = pids["device"]
    assert slice_of(device) == SHORT_SLICE_NS  # the main thread is the control thread
    # every other thread (the engine thread, its ggml pool worker, ...) keeps the
    # default slice: they were started before the control thread asked
    others = {t: slice_of(device, int(t)) for t in os.listdir(f"/proc/{device}/task")
              if int(t) != device}
    assert others and all(v is not None and v != SHORT_SLICE_NS for v in others.values()), others


def engine_threads(service: Service) -> tuple[float, float]:
    with service.client() as c:
        text = c.get("/metrics").text
    found = [re.search(rf'^{name}{{model="smollm2"}} ([0-9.e+]+)$', text, re.M)
             for name in ("aotx_engine_threads", "aotx_engine_thread_changes_total")]
    assert found[0] and found[1], text[-2000:]
    return float(found[0][1]), float(found[1][1])


def test_the_engine_leaves_a_busy_core_to_its_process(service: Service) -> None:
    """Beside a process that keeps a core busy, the decode runs on one thread fewer
    (engine/llama/cores.py): ggml's threads would otherwise spin at every barrier while
    one of them waits for that core."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: the engine runs one thread anyway")
    threads, _ = engine_threads(service)
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 48, "temperature": 0}
        decoded = 0.0
        with service.client() as c:
            while decoded < 3 * PERIOD:  # the windows the count is decided on
                t0 = time.monotonic()
                assert c.post("/v1/chat/completions", json=body, timeout=120).status_code == 200
                decoded += time.monotonic() - t0
        busy, _ = engine_threads(service)
    finally:
        hog.kill()
        hog.wait()
    assert busy <= min(threads, cores - 1)
