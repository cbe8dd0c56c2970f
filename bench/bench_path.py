"""Where a streamed token's CPU time goes: every aotx process and every thread of the
device, per streamed token, while N streaming chat completions decode (aotx at its
defaults, no models file, or with ``--threads N`` decode threads).

    .venv/bin/python -m bench.bench_path [--clients 1,4,8] [--requests 2] [--max-tokens 128]
        [--py-spy /path/to/py-spy] [--cprofile] [--client httpx|raw] [--thin | --threads N]

For each N, N clients each stream ``--requests`` chat completions one after another
(temperature 0, distinct prompts, a fresh connection per request); the CPU time each
process and each device thread spent during the load (each thread's time on a CPU, from
/proc's schedstat, in nanoseconds, taken thread by thread: a thread that ends during the
load drops out, one that starts counts from zero) is divided by the tokens streamed. The
device's busiest threads are ggml's (one a core, or ``--threads``): the engine thread
(the scheduler's Python and the decode's share) and ggml's workers (the decode only), so
a worker's figure is the decode's own cost per token per thread. The client (this
process: httpx, or with ``--client raw`` asyncio's streams, and the SSE parsing, as in
``bench_serve``) and the machine's interrupt time (loopback TCP's softirq) are what any
server's clients on the same machine would cost. A row ``machine idle`` is the CPU time
nobody used: wall time × the cores minus aotx's processes and the client (with
``--py-spy``, py-spy's own CPU is counted there too). With ``--thin`` the same is
measured for ``bench/thin_server.py`` (one process: its engine thread, ggml's worker and
the event loop's thread, the least a server's path can cost here) with aotx's default
slots. ``--threads 1`` leaves aotx's decode one thread, and so a core free for the rest:
what the path costs when it need not take a core from ggml.

With ``--py-spy`` (a py-spy binary: ``pip download py-spy``, not a dependency) the
gateway, the broker and the device are sampled during each load (``py-spy record
--nonblocking``: their Python threads' stacks, where py-spy counts the thread active,
which includes a thread inside a system call) and the time is printed per process as
ms per streamed token by the Python function that was running (its own time; a call
into a C library counts as the function that made it, so ``engine.py:decode_batch`` is
the engine thread's share of ``llama_decode``).  Where the time is, not its exact CPU.

With ``--cprofile`` each process's main thread (the gateway's and the broker's event
loop, the device's control thread; the thin server's event loop) runs under cProfile
with the thread's CPU clock as its timer (``bench/cprofile_site``, put first on their
``PYTHONPATH``, before any the caller set), and the functions that used the most CPU
of it during each load are printed per streamed token, by their own time.  cProfile
slows those threads (up to about twice their time), and so the decode beside them: take
the calls and the shares from such a run, the CPU and the speed from one without it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import pstats
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

from bench import common
from bench.bench_memory import tree
from bench.bench_serve import CLIENT, run_load

TICK = os.sysconf("SC_CLK_TCK")
ENGINES = ("device", "thin")  # the processes that decode: their threads are shown apart


def cpu(path: str) -> float | None:
    """A thread's time on a CPU, from /proc/.../task/TID/schedstat, in seconds (None once
    it is gone): nanoseconds, where /proc/.../stat counts 10 ms ticks, too coarse for a
    process that runs 0.2 ms a token."""
    try:
        with open(path) as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def switches(path: str) -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches of /proc/.../status (None once it is
    gone): a voluntary one is a wake-up after a wait; an involuntary one a preemption."""
    try:
        with open(path) as f:
            rows = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        return int(rows["voluntary_ctxt_switches"]), int(rows["nonvoluntary_ctxt_switches"])
    except (OSError, KeyError, ValueError):
        return None


def softirq() -> float:
    """The machine's irq + softirq time, in seconds (the network stack's share of the
    loopback traffic is mostly here)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[6]) + int(fields[7])) / TICK


def name(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        args = f.read().split("\0")
    for role in ("gateway", "broker", "device", "supervise", "serve"):
        if role in args:
            return role
    return "thin" if "bench.thin_server" in args else " ".join(args)[:40]


def snapshot(root: int) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """CPU seconds and (voluntary, involuntary) context switches of every thread of the
    tree, keyed 'ROLE/TID'.  Kept by thread, so that a thread that ends between two
    snapshots drops out of their difference instead of taking its whole life's CPU off
    its process's."""
    used: dict[str, float] = {}
    ctx: dict[str, tuple[int, int]] = {}
    for pid in tree(root):
        role = name(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:  # (one that ends meanwhile is left out, as one that ended before)
            ran = cpu(f"/proc/{pid}/task/{tid}/schedstat")
            woke = switches(f"/proc/{pid}/task/{tid}/status")
            if ran is not None and woke is not None:
                used[f"{role}/{tid}"], ctx[f"{role}/{tid}"] = ran, woke
    return used, ctx


def with_roles(per_thread: dict[str, float]) -> dict[str, float]:
    """``per_thread`` ('ROLE/TID' keys) with each role's sum added under 'ROLE'."""
    out = dict(per_thread)
    for key, value in per_thread.items():
        role = key.split("/", 1)[0]
        out[role] = out.get(role, 0.0) + value
    return out


RATE = 200  # py-spy samples a second


def spy(binary: str, root: int, folder: str) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """py-spy recording the gateway, the broker and the device (or the thin server)
    into ``folder``."""
    out = []
    for pid in tree(root):
        role = name(pid)
        if role in ("gateway", "broker", *ENGINES):
            cmd = [binary, "record", "--pid", str(pid), "--rate", str(RATE), "--format",
                   "raw", "--nonblocking", "-o", os.path.join(folder, role)]
            out.append((role, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL)))
    return out


def frame_name(frame: str) -> str:
    """``func (file.py:line)`` as ``file.py:func``."""
    func, _, where = frame.partition(" (")
    return f"{os.path.basename(where.rstrip(')').split(':')[0])}:{func}" if where else func


def spied(folder: str, role: str, tokens: int, top: int = 8) -> list[str]:
    """The lines to print for one process's samples: its active time by leaf Python
    function, ms per streamed token."""
    own: collections.Counter[str] = collections.Counter()
    try:
        with open(os.path.join(folder, role)) as f:
            for line in f:
                stack, _, count = line.rstrip().rpartition(" ")
                own[frame_name(stack.split(";")[-1])] += int(count)
    except (OSError, ValueError):
        return [f"    ({role}: no samples)"]
    return [f"    {1e3 * n / RATE / tokens:7.3f}  {leaf}" for leaf, n in own.most_common(top)]


SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cprofile_site")
PROFILED = ("gateway", "broker", *ENGINES)


def catches_usr1(pid: int) -> bool:
    """Whether ``pid`` has a handler for SIGUSR1 (``cprofile_site``'s): a process without
    one would be ended by it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caught >> (signal.SIGUSR1 - 1) & 1)


def profile_all(root: int, folder: str) -> None:
    """Have every profiled process (``cprofile_site``) write its profile so far to
    ``folder`` and start afresh; return once every one has."""
    roles = []
    for pid in tree(root):
        try:
            role = name(pid)
        except OSError:  # (ended meanwhile)
            continue
        if role in PROFILED and catches_usr1(pid):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, f"{role}.pstats"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
                roles.append(role)
    if not roles:
        raise SystemExit("no served process has the profiler (bench/cprofile_site)")
    deadline = time.monotonic() + 30
    while not all(os.path.exists(os.path.join(folder, f"{r}.pstats")) for r in roles):
        if time.monotonic() > deadline:
            raise SystemExit("a profiled process wrote no profile in 30 s")
        time.sleep(0.05)


def profiled(folder: str, role: str, tokens: int, top: int = 10) -> list[str]:
    """The lines to print for one process's profile (its main thread): CPU ms per
    streamed token by function (its own time), and its share of the thread's."""
    st = pstats.Stats(os.path.join(folder, f"{role}.pstats"))
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    total = st.total_tt  # type: ignore[attr-defined]
    out = [f"  cProfile, {role} (main thread): {1e3 * total / tokens:.3f} ms per streamed "
           f"token profiled, {st.total_calls / tokens:.0f} calls"]  # type: ignore[attr-defined]
    for (path, line, func), (_, calls, own, _, _) in rows[:top]:
        where = f"{os.path.basename(path)}:{line}:{func}" if line else func
        out.append(f"    {1e3 * own / tokens:7.3f}  {own / total:4.0%}  {calls / tokens:5.2f} "
                   f"calls  {where}")
    return out


@contextlib.contextmanager
def serving(thin: bool, threads: int, env: dict[str, str]) -> Iterator[common.Server]:
    """aotx at its defaults (but ``threads``, when given), or the thin server with aotx's
    default slots (16 of 4,096); ``env`` added to their environment."""
    if not thin:
        with common.serving(f"[default]\nthreads = {threads}\n" if threads else "",
                            env=env) as svc:
            yield svc
        return
    svc = common.thin(16, 4096, env)
    try:
        yield svc
    finally:
        svc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--py-spy", help="a py-spy binary: profile the processes by function")
    ap.add_argument("--cprofile", action="store_true",
                    help="profile each process's main thread with cProfile (its CPU clock)")
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                    help="the streaming clients' library (bench_serve.raw_lines)")
    ap.add_argument("--thin", action="store_true",
                    help="measure bench/thin_server.py (one process) instead of aotx")
    ap.add_argument("--threads", type=int, default=0,
                    help="aotx's decode threads (the models file's threads; 0: its default)")
    args = ap.parse_args()
    if args.thin and args.threads:
        ap.error("--threads sets aotx's decode threads; the thin server follows the cores")
    CLIENT["library"] = args.client
    profiles = tempfile.mkdtemp(prefix="aotx-cprofile-") if args.cprofile else ""
    # (first on the path, before any the caller set: another llama.cpp build's)
    path = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "AOTX_BENCH_CPROFILE": profiles} if profiles else {}
    try:
        with serving(args.thin, args.threads, env) as svc:
            assert svc.proc is not None
            asyncio.run(run_load(svc.url, svc.headers, "smollm2", 1, 1, 16, 900))  # warm
            for n in (int(x) for x in args.clients.split(",")):
                measure(svc, n, args, profiles)
    finally:
        if profiles:
            shutil.rmtree(profiles, ignore_errors=True)


def measure(svc: common.Server, n: int, args: argparse.Namespace, profiles: str) -> None:
    """One load of ``n`` clients: its CPU a token by process and thread, printed."""
    assert svc.proc is not None
    folder = tempfile.mkdtemp(prefix="aotx-spy-") if args.py_spy else ""
    spies = spy(args.py_spy, svc.proc.pid, folder) if args.py_spy else []
    if profiles:
        profile_all(svc.proc.pid, profiles)  # (what came before the load: dropped)
    (before, ctx0), t0 = snapshot(svc.proc.pid), time.perf_counter()
    if not any(before.values()):
        print("no CPU times in /proc/*/task/*/schedstat: every figure reads 0")
    me0, irq0 = time.process_time(), softirq()
    load = asyncio.run(run_load(svc.url, svc.headers, "smollm2", n, args.requests,
                                args.max_tokens, 100 * n))
    wall, (after, ctx1) = time.perf_counter() - t0, snapshot(svc.proc.pid)
    me1, irq1 = time.process_time(), softirq()
    if profiles:
        profile_all(svc.proc.pid, profiles)
    for _, proc in spies:  # py-spy writes its file when interrupted
        proc.send_signal(2)
        proc.wait(60)
    tokens = load["tokens"]
    used = with_roles({k: v - before.get(k, 0.0) for k, v in after.items()})
    woke = with_roles({k: v[0] - ctx0.get(k, (0, 0))[0] for k, v in ctx1.items()})
    preempted = with_roles({k: v[1] - ctx0.get(k, (0, 0))[1] for k, v in ctx1.items()})
    print(f"N={n}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s); "
          "CPU ms per streamed token:")
    threads = per_process(used, tokens, args.threads)
    print(f"  {f'client (this process: {args.client}, SSE parsing)':10s} "
          f"{1e3 * (me1 - me0) / tokens:7.3f}")
    print(f"  {'interrupts (irq + softirq, whole machine)':10s} "
          f"{1e3 * (irq1 - irq0) / tokens:7.3f}")
    print("  wake-ups (voluntary) / preemptions (involuntary) per streamed token:")
    for k, label in [(r, r) for r in ("gateway", "broker", *ENGINES) if r in woke] + [
            (k, "  " + label) for k, label in threads]:
        print(f"    {label:36s} {woke[k] / tokens:6.2f} / {preempted[k] / tokens:5.2f}")
    cores = len(os.sched_getaffinity(0))
    idle = cores * wall - sum(v for k, v in used.items() if "/" not in k) - (me1 - me0)
    print(f"  {'machine idle':10s} {1e3 * idle / tokens:7.3f}", flush=True)
    for role, _ in spies:
        print(f"  py-spy, {role}: active ms per streamed token by function")
        print("\n".join(spied(folder, role, tokens)), flush=True)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    for role in PROFILED if profiles else ():
        if os.path.exists(os.path.join(profiles, f"{role}.pstats")):
            print("\n".join(profiled(profiles, role, tokens)), flush=True)


def per_process(used: dict[str, float], tokens: int, threads: int) -> list[tuple[str, str]]:
    """Print each process's CPU a token and the engine's threads'; return the engine's
    busiest threads with their labels."""
    ggml = threads or len(os.sched_getaffinity(0))  # (the thin server's: every core)
    labels = ["engine thread (decode + scheduler)"] + ["ggml worker (decode only)"] * (ggml - 1)
    busiest = sorted((k for k in used if k.split("/")[0] in ENGINES and "/" in k),
                     key=lambda k: -used[k])
    for role in ("gateway", "broker", "supervise", "serve", *ENGINES):
        if role in used:
            print(f"  {role:10s} {1e3 * used[role] / tokens:7.3f}")
    for k, label in zip(busiest, labels, strict=False):
        print(f"    {label:36s} {1e3 * used[k] / tokens:7.3f}")
    rest = sum(used[k] for k in busiest[len(labels):])
    print(f"    {'its other threads':36s} {1e3 * rest / tokens:7.3f}")
    return list(zip(busiest, labels, strict=False))


if __name__ == "__main__":
    main()
