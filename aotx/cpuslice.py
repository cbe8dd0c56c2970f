"""CPU scheduling hints for the latency-sensitive threads.

While a model decodes, its threads keep every core busy.  Under Linux's EEVDF
scheduler (6.6 and later) a thread that wakes up (the gateway on a new
request, the broker on a packet, the device's control thread on a doorbell)
may wait for the running decode thread to finish its time slice (1.4 ms on a
2-core machine with the default settings), and each hop of a request's path pays that wait again.  A thread that asks for
a short slice (``sched_setattr`` with ``sched_runtime`` for a normal-priority
thread, Linux 6.12 and later) gets earlier deadlines and preempts the decode
at once; it uses little CPU, so the decode loses nothing measurable.
Kernels before 6.12 accept the call and ignore the slice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct

log = logging.getLogger("aotx.sched")

_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
#: The shortest slice the kernel accepts (100 us).
SHORT_SLICE_NS = 100_000


def request_short_slice(enabled: bool = True, slice_ns: int = SHORT_SLICE_NS) -> bool:
    """Ask for a short time slice for the calling thread (its policy, normal or batch,
    and its nice value kept).  Threads it starts afterwards inherit it.  Returns False
    where the kernel or the platform does not support it (nothing changes then), or
    where it is not ``enabled`` (``AOTX_SHORT_SLICE=0``, read by :mod:`aotx.config`)."""
    if not enabled:
        return False
    nr = _SYS_SCHED_SETATTR.get(platform.machine())
    if nr is None or not hasattr(os, "sched_getscheduler"):
        return False
    policy = os.sched_getscheduler(0)
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return False  # real-time or idle: an operator's choice, left alone
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    # struct sched_attr, version 0 (48 bytes): size, policy, flags, nice, priority,
    # runtime (for a normal or batch thread: the slice, ns), deadline, period.
    attr = ctypes.create_string_buffer(struct.pack("<IIQiIQQQ", 48, policy, 0, nice, 0,
                                                   slice_ns, 0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, 0, attr, 0) != 0:
        log.debug("sched_setattr failed: errno %d", ctypes.get_errno())
        return False
    return True
