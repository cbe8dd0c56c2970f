"""The running service asks for short scheduler slices on its path threads."""

from __future__ import annotations

import os

import pytest

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
