"""Profiles an aotx process's main thread for ``bench_path --cprofile`` (this folder is
put first on the served processes' ``PYTHONPATH``; nothing happens without
``AOTX_BENCH_CPROFILE``).  The gateway's and the broker's main thread is their event
loop, the device's its control thread, the thin server's its event loop: cProfile with
the thread's CPU clock as its timer, so that a function's time is CPU, not waiting.
SIGUSR1 writes the profile so far to ``$AOTX_BENCH_CPROFILE/ROLE.pstats`` and starts
afresh."""

from __future__ import annotations

import os

_FOLDER = os.environ.get("AOTX_BENCH_CPROFILE")


def _role() -> str | None:
    with open("/proc/self/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    if b"bench.thin_server" in args:
        return "thin"
    if b"aotx" not in args:
        return None
    return next((r for r in ("gateway", "broker", "device") if r.encode() in args), None)


def _start(folder: str, role: str) -> None:
    import cProfile
    import signal
    import time

    profile = cProfile.Profile(timer=time.thread_time)

    def dump(*_: object) -> None:
        profile.disable()
        path = os.path.join(folder, f"{role}.pstats")
        profile.dump_stats(path + ".part")
        os.replace(path + ".part", path)  # whole when it appears
        profile.clear()
        profile.enable()

    signal.signal(signal.SIGUSR1, dump)
    profile.enable()


if _FOLDER:
    _ROLE = _role()
    if _ROLE is not None:
        _start(_FOLDER, _ROLE)
