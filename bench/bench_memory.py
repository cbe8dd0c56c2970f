"""Resident memory of a whole service while 16 streams run, and at rest after them: aotx
with a models file of your choice against llama-server at its defaults.

    .venv/bin/python -m bench.bench_memory [--models 'TOML'] [--peer PATH/llama-server]

Each server is started on the embedded SmolLM2 GGUF; 16 streaming chat completions of
128 tokens run at once (distinct prompts) while the resident set of every process of
the server's tree is sampled every 50 ms; the peak of their sum is printed, then the sum
at rest after the streams.  aotx's processes are listed one by one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import threading
import time

import httpx

from bench import common

STREAMS = 16


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load(url: str, headers: dict[str, str], model: str) -> None:
    def one(i: int) -> None:
        body = {"model": model, "stream": True, "max_tokens": 128, "temperature": 0.7,
                "messages": [{"role": "user", "content": f"Story {i}: tell me about a {i}-legged cat."}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=600) as r:
            for _ in r.iter_bytes():
                pass
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as ex:
        list(ex.map(one, range(STREAMS)))


def measure(root: int, url: str, headers: dict[str, str], model: str) -> tuple[int, int, dict[int, int]]:
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, sum(rss(p) for p in tree(root)))
            time.sleep(0.05)
    t = threading.Thread(target=sample)
    t.start()
    load(url, headers, model)
    done.set()
    t.join()
    time.sleep(1)
    per = {p: rss(p) for p in tree(root)}
    return peak, sum(per.values()), per


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="", help="aotx's models.toml (default: none)")
    ap.add_argument("--peer", default=os.environ.get("LLAMA_SERVER", ""))
    args = ap.parse_args()
    mib = 1 << 20
    with common.serving(args.models.replace("\\n", "\n")) as svc:
        assert svc.proc is not None
        peak, rest, per = measure(svc.proc.pid, svc.url, svc.headers, "smollm2")
        names = {pid: open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:60]
                 for pid in per if os.path.exists(f"/proc/{pid}/cmdline")}
        print(f"aotx ({args.models or 'no models file'}): peak {peak / mib:.0f} MiB with "
              f"{STREAMS} streams, {rest / mib:.0f} MiB at rest")
        for pid, n in sorted(per.items(), key=lambda x: -x[1]):
            print(f"  {n / mib:6.0f} MiB  {names.get(pid, pid)}")
    if args.peer and os.path.exists(args.peer):
        peer = common.peer(args.peer)  # at its defaults
        try:
            assert peer.proc is not None
            peak, rest, _ = measure(peer.proc.pid, peer.url, {}, "smollm2")
            print(f"llama-server (defaults): peak {peak / mib:.0f} MiB, {rest / mib:.0f} MiB at rest")
        finally:
            peer.stop()

if __name__ == "__main__":
    main()
