"""Serving benchmark: aotx against the raw engine limit (and a peer server, if given).

    .venv/bin/python -m bench.bench_serve [--clients 1,4,8,16] [--max-tokens 128]
        [--requests 2] [--rounds 2] [--seconds 5] [--defaults] [--thin] [--client raw]
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python -m bench.bench_serve  # A B A B vs a peer
    LLAMA_SERVER=http://127.0.0.1:8080 ...                                      # a running peer

For each N it runs rounds (``--rounds``, 2 by default); each round measures the
raw-engine limit (N sequences in one llama_decode batch, in a separate process that
stays loaded for the whole run), then N concurrent streaming ``/v1/chat/completions``
clients against aotx (temperature 0, distinct prompts, a fresh connection per request;
httpx, or with ``--client raw`` asyncio's streams and a chunked decoder, ``raw_lines``,
which cost the client less a token), then the same load against the peer if one is given
(one server at a time: A B A B), and with ``--thin`` the same load against
``thin_server.py`` (the same engine behind the thinnest server: what any server loses
here to its clients and their arrivals). It prints per N the aggregate completion tok/s,
TTFT p50/p95, inter-token p50/p95, the limit and the ratio aotx/limit, and beside it the
engine alone doing the same requests (each client's first prompt after the cached
template prefix, all in one batch, then the decode steps: the prompt work the limit
leaves out) with the ratio against that, and a line splitting each one's time into its
time a token within a stream (first streamed token to last; the engine alone: a decode
step of the same requests) and its time a request outside that (connection, prompt, first
token, the response's end and, at N > 1, a client's wait for the others; the engine
alone: the prompts' batch). A ratio is the median of the rounds' ratios
(each round's are printed in brackets): this VM's speed drifts, so each ratio compares
figures measured within minutes of each other. Then the native path (admission -> SSE
until terminal), admission latency while 8 streams decode, and window-read throughput on
2 keep-alive connections. The admissions and the window reads use a minimal keep-alive
HTTP/1.1 client (``RawHttp``) so that the client library's own cost is not what is
measured; admission latency is also printed with httpx as the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from bench import common

TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "a desert", "rain",
          "a train journey", "a forest", "the moon", "a market", "winter", "a lighthouse",
          "a river", "a garden", "a storm", "a bridge", "a clock", "a violin", "bees", "snow"]


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} "
                                        f"(number {i})."}]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


RAW = r"""
import json, sys, time
from aotx.device.loading import template_prefix
from aotx.engine.interface import BatchEntry
from aotx.engine.llama.sampling import Sampler
from aotx.device.template import ChatTemplate
from bench import common
slots = int(sys.argv[1])
e = common.engine(slots=slots, slot_context=1024, batch=512)
t = ChatTemplate(e.metadata("tokenizer.chat_template"))
prefix = template_prefix(e, t)
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    n, steps, chats = job["n"], job["steps"], job["chats"]
    for q in range(slots):
        e.clear_sequence(q)
    prompts = [e.tokenize(t.render([{"role": "user", "content": f"Write a short story about topic {q}."}]), False) for q in range(n)]
    ss = [Sampler(0.0, 1.0, 0) for _ in range(n)]
    cur = []
    for q, p in enumerate(prompts):
        assert e.decode([BatchEntry(tok, i, q, i == len(p) - 1) for i, tok in enumerate(p)]) == 0
        cur.append(e.sample(ss[q], len(p) - 1))
    pos = [len(p) for p in prompts]
    t0 = time.perf_counter()
    for s in range(steps):
        assert e.decode([BatchEntry(cur[q], pos[q] + s, q, True) for q in range(n)]) == 0
        cur = [e.sample(ss[q], q) for q in range(n)]
    decode_only = n * steps / (time.perf_counter() - t0)
    # The same requests as the benchmark's clients, done by the engine alone: the
    # template prefix cached in sequence 0 (as the service warms it) and copied to
    # the others, every prompt's rest evaluated in one batch, then the decode steps.
    for q in range(slots):
        e.clear_sequence(q)
    assert e.decode([BatchEntry(tok, i, 0, False) for i, tok in enumerate(prefix)]) == 0
    prompts = [e.tokenize(t.render(chats[q]), False) for q in range(n)]
    t0 = time.perf_counter()
    for q in range(1, n):
        e.copy_sequence(0, q)
    entries = []
    for q, p in enumerate(prompts):
        entries += [BatchEntry(p[i], i, q, i == len(p) - 1) for i in range(len(prefix), len(p))]
    assert e.decode(entries) == 0
    last = [i for i, x in enumerate(entries) if x.logits]
    cur = [e.sample(ss[q], last[q]) for q in range(n)]
    prompt_s = time.perf_counter() - t0
    pos = [len(p) for p in prompts]
    for s in range(steps - 1):
        assert e.decode([BatchEntry(cur[q], pos[q] + s, q, True) for q in range(n)]) == 0
        cur = [e.sample(ss[q], q) for q in range(n)]
    print(json.dumps([decode_only, n * steps / (time.perf_counter() - t0), prompt_s]), flush=True)
"""


class JsonProcess:
    """A measuring process that stays loaded for the whole run, so that each round
    measures right before the servers' loads (this VM's speed drifts by 2 x within an
    hour: a figure taken once at the start is not comparable with a load ten minutes
    later).  It prints "ready" once loaded, then answers each JSON line on its stdin
    with one JSON line."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, *argv], text=True, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     cwd=common.REPO)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {name} process did not start")

    def ask(self, job: object) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} process died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RawEngine(JsonProcess):
    """The engine alone, measuring the limit of each round."""

    def __init__(self, slots: int) -> None:
        super().__init__(["-c", RAW, str(slots)], "raw engine")

    def measure(self, n: int, steps: int, per_client: int = 1) -> tuple[float, float, float]:
        """(the limit: n sequences decoding together, tok/s; the engine alone doing
        the clients' first requests: their prompts after the cached template prefix
        in one batch, then the decode steps, completion tok/s; the seconds of that
        prompt batch, up to the first tokens)."""
        chats = [prompt(k * per_client) for k in range(n)]  # each client's first request
        decode_only, same_work, prompt_s = self.ask({"n": n, "steps": steps, "chats": chats})
        return float(decode_only), float(same_work), float(prompt_s)


_CLIENTS: dict[str, httpx.AsyncClient] = {}


def fresh_conn_client(base: str) -> httpx.AsyncClient:
    """One client object per server, but a fresh TCP connection for every request
    (no keep-alive), so the figures include connection set-up but not the client
    library's own start-up cost."""
    c = _CLIENTS.get(base)
    if c is None or c.is_closed:
        c = httpx.AsyncClient(base_url=base, timeout=300,
                              limits=httpx.Limits(max_keepalive_connections=0,
                                                  max_connections=256))
        _CLIENTS[base] = c
    return c


#: the streaming clients' library: "httpx" (what applications use) or "raw" (raw_lines)
CLIENT = {"library": "httpx"}


async def stream_chat(base: str, headers: dict[str, str], model: str, i: int,
                      max_tokens: int, extra: dict[str, object] | None = None
                      ) -> dict[str, float]:
    body = {"model": model, "messages": prompt(i), "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for line in (raw_lines if CLIENT["library"] == "raw" else httpx_lines)(
            base, "/v1/chat/completions", json.dumps(body).encode(), headers):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        for ch in obj.get("choices") or []:
            if ch["delta"].get("content"):
                stamps.append(time.perf_counter())
    return {"t0": t0, "end": time.perf_counter(), "stamps": stamps, "tokens": tokens}  # type: ignore[dict-item]


async def httpx_lines(base: str, path: str, body: bytes, headers: dict[str, str]
                      ) -> AsyncIterator[str]:
    c = fresh_conn_client(base)
    async with c.stream("POST", path, content=body, headers={
            **headers, "Content-Type": "application/json"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            yield line


async def raw_lines(base: str, path: str, body: bytes, headers: dict[str, str]
                    ) -> AsyncIterator[str]:
    """A response's lines through the least client: asyncio's streams and a chunked
    decoder, a fresh connection a request as with httpx.  It shows how much of a
    server's figure is the client's own work on these two cores (httpx's per-chunk
    parsing), which every server here pays alike."""
    host, port = base.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
        writer.write(head.encode() + body)
        got = await reader.readuntil(b"\r\n\r\n")
        if got[9:12] != b"200":
            raise RuntimeError(f"{path}: {got!r}")
        chunked = b"transfer-encoding: chunked" in got.lower()
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(65536)
            if not data:
                break
            *lines, buf = (buf + data).split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
    finally:
        writer.close()


async def run_load(base: str, headers: dict[str, str], model: str, n: int, per_client: int,
                   max_tokens: int, offset: int, extra: dict[str, object] | None = None) -> dict:
    results: list[dict] = []

    async def client(k: int) -> None:
        for j in range(per_client):
            results.append(await stream_chat(base, headers, model, offset + k * per_client + j,
                                             max_tokens, extra))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(n)))
    wall = time.perf_counter() - t0
    await fresh_conn_client(base).aclose()
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    tokens = sum(r["tokens"] or len(r["stamps"]) for r in results)
    # Each request's time from its first streamed token to its last (the decode steps a
    # client sees), and the rest of the clients' time (connection, prompt, first token,
    # the end of the response; and a client that ended first waiting for the others):
    # what splits a server's tok/s into its steps and its requests' turnover (``split``).
    # A chunk may carry more than one token: the span is divided by the tokens after
    # each request's first (its usage's count, else its chunks').
    span = sum(r["stamps"][-1] - r["stamps"][0] for r in results if r["stamps"])
    gaps = sum((r["tokens"] or len(r["stamps"])) - 1 for r in results if r["stamps"])
    return {"tok_s": tokens / wall, "ttft": ttft, "itl": itl, "tokens": tokens,
            "inside": span / max(1, gaps),
            "outside": (n * wall - span) / max(1, len(results))}


async def native_load(base: str, headers: dict[str, str], n: int, max_tokens: int) -> float:
    async def one(i: int) -> int:
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as c:
            r = await c.post("/aotx/v1/requests", json={
                "model": "smollm2", "messages": prompt(1000 + i), "temperature": 0,
                "max_tokens": max_tokens})
            rid = r.json()["id"]
            async with c.stream("GET", f"/aotx/v1/requests/{rid}/events") as s:
                async for _ in s.aiter_lines():
                    pass
            return int((await c.get(f"/aotx/v1/requests/{rid}")).json()["usage"]
                       ["completion_tokens"])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return tokens / (time.perf_counter() - t0)


class RawHttp:
    """A minimal keep-alive HTTP/1.1 client: httpx itself costs more per request on
    this machine (~2 ms after an idle gap) than the server does, and would measure
    the client instead of the server."""

    def __init__(self, base: str, headers: dict[str, str]) -> None:
        self.host, port = base.split("//")[1].split(":")
        self.port = int(port)
        self.auth = headers["Authorization"]
        self.reconnects = 0

    async def __aenter__(self) -> RawHttp:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Authorization: {self.auth}\r\n")
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        got = await self.reader.readuntil(b"\r\n\r\n")
        length = int(got.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = await self.reader.readexactly(length)
        if b"\r\nconnection: close" in got.lower():  # (llama-server: every 100 requests)
            self.writer.close()
            self.reconnects += 1
            await self.__aenter__()
        return int(got[9:12]), body


async def admission_latency(base: str, headers: dict[str, str], samples: int = 60,
                            raw: bool = True) -> list[float]:
    """POST /aotx/v1/requests one after another while 8 streams decode, each timed
    from the first byte sent to the last byte of the 202 (a minimal client, or httpx)."""
    bg = [asyncio.create_task(stream_chat(base, headers, "smollm2", 2000 + i, 256))
          for i in range(8)]
    await asyncio.sleep(2.0)  # the 8 streams are decoding
    lat = []
    async with RawHttp(base, headers) as rc, httpx.AsyncClient(
            base_url=base, headers=headers, timeout=60) as c:
        for i in range(samples):
            body = {"model": "smollm2", "messages": prompt(3000 + i), "max_tokens": 1}
            raw_body = json.dumps(body).encode()
            t0 = time.perf_counter()
            if raw:
                status, text = await rc.request("POST", "/aotx/v1/requests", raw_body)
            else:
                r = await c.post("/aotx/v1/requests", json=body)
                status, text = r.status_code, r.content
            lat.append(time.perf_counter() - t0)
            assert status == 202, text
    await asyncio.gather(*bg)
    return lat


async def window_reads(base: str, headers: dict[str, str], seconds: float) -> float:
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as c:
        rid = (await c.post("/aotx/v1/requests", json={
            "model": "smollm2", "messages": prompt(5), "max_tokens": 64})).json()["id"]
        while (await c.get(f"/aotx/v1/requests/{rid}")).json()["state"] != "completed":
            await asyncio.sleep(0.05)
    return await rate(base, headers, f"/aotx/v1/requests/{rid}", seconds)


async def rate(base: str, headers: dict[str, str], path: str, seconds: float) -> float:
    """Requests per second of ``GET path`` on 2 keep-alive connections, each 200."""
    count = 0
    end = time.perf_counter() + seconds

    async def conn() -> None:
        nonlocal count
        async with RawHttp(base, headers) as rc:
            while time.perf_counter() < end:
                status, body = await rc.request("GET", path)
                assert status == 200, body[:200]
                count += 1

    t0 = time.perf_counter()
    await asyncio.gather(conn(), conn())
    return count / (time.perf_counter() - t0)


def cpu_times() -> list[int]:
    """The machine's CPU time counters (user, nice, system, idle, iowait, irq, softirq,
    steal), in clock ticks, or [] where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """Share of CPU time the hypervisor took from this machine (steal) between two samples."""
    if len(before) < 8 or len(after) < 8:
        return None
    d = [b - a for a, b in zip(before, after, strict=True)]
    return d[7] / sum(d) if sum(d) else None


def summary(rounds: list[dict], key: str) -> dict[str, float]:
    """One server's loads over the rounds: mean tok/s, and the latency percentiles of
    all its requests together."""
    ttft = [x for r in rounds for x in r[key]["ttft"]]
    itl = [x for r in rounds for x in r[key]["itl"]]
    return {"tok_s": statistics.mean(r[key]["tok_s"] for r in rounds),
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95)}


def split(rounds: list[dict], key: str) -> str:
    """A server's time a token within a stream (first streamed token to last) and its
    time a request outside that (its prompt, first token and end; at N > 1 also a
    client's wait for the others at the end), medians over the rounds, in ms, and the
    median of the rounds' ratios of the engine alone's step to its time a token; for
    ``same_work`` (the engine alone) its decode step and its prompts' batch.  At N > 1
    a server's later requests are prompted beside the running streams, inside their
    time a token, where the engine alone batches the prompts first."""
    inside = statistics.median(r[key]["inside"] for r in rounds)
    outside = statistics.median(r[key]["outside"] for r in rounds)
    name = "engine alone" if key == "same_work" else key
    text = f"{name} {inside * 1e3:.2f} ms a token + {outside * 1e3:.1f} ms a request"
    if key == "same_work":
        return text
    steps = [r["same_work"]["inside"] / r[key]["inside"] for r in rounds]
    return text + f" (step ratio {median_each(steps)})"


def engine_split(n: int, steps: int, same_work: float, prompt_s: float) -> dict[str, float]:
    """The engine alone's ``inside`` (a decode step of the same requests' n sequences)
    and ``outside`` (their prompts' batch, up to the first tokens) in seconds."""
    whole = n * steps / same_work
    return {"inside": (whole - prompt_s) / max(1, steps - 1), "outside": prompt_s}


def ratios(rounds: list[dict], num: str, den: str) -> str:
    """The median of the rounds' ratios num/den (each round's figures were measured
    minutes apart at most), and each round's ratio."""
    return median_each([r[num]["tok_s"] / r[den]["tok_s"] for r in rounds])


def median_each(rs: list[float]) -> str:
    """The median of the rounds' ratios ``rs``, and each round's (more than one)."""
    each = "/".join(f"{x:.2f}" for x in rs)
    return f"{statistics.median(rs):.2f}" + (f" [{each}]" if len(rs) > 1 else "")


def report(n: int, rounds: list[dict], others: list[str]) -> float:
    """Print the load of ``n`` clients: each server's figures and ratios, and the split
    of their time; return aotx's median inter-token time."""
    a = summary(rounds, "aotx")
    line = (f"N={n:2d}  aotx {a['tok_s']:6.1f} tok/s  "
            f"limit {statistics.mean(r['limit']['tok_s'] for r in rounds):6.1f}  "
            f"ratio {ratios(rounds, 'aotx', 'limit')}  (engine alone on the same requests "
            f"{statistics.mean(r['same_work']['tok_s'] for r in rounds):6.1f}, "
            f"ratio {ratios(rounds, 'aotx', 'same_work')})  "
            f"TTFT p50 {a['ttft_p50'] * 1e3:6.1f} ms p95 {a['ttft_p95'] * 1e3:6.1f} ms  "
            f"ITL p50 {a['itl_p50'] * 1e3:5.1f} ms p95 {a['itl_p95'] * 1e3:5.1f} ms")
    for key in others:  # the thin server's against the engine alone too
        o = summary(rounds, key)
        alone = f"thin/same work {ratios(rounds, key, 'same_work')}, " if key == "thin" else ""
        line += (f"  {key} {o['tok_s']:6.1f} tok/s ({alone}aotx/{key} "
                 f"{ratios(rounds, 'aotx', key)}) {key} TTFT p50 "
                 f"{o['ttft_p50'] * 1e3:6.1f} ms ITL p50 {o['itl_p50'] * 1e3:5.1f} ms")
    print(line, flush=True)
    print(f"       time split: {split(rounds, 'same_work')}; "
          + "; ".join(split(rounds, key) for key in ("aotx", *others)), flush=True)
    return float(a["itl_p50"])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per N, each: the raw engine, aotx, then the peer (if given)")
    ap.add_argument("--seconds", type=float, default=5.0, help="window-read duration")
    ap.add_argument("--defaults", action="store_true",
                    help="both servers at their defaults (aotx: no models file; the peer: "
                         "-t 2 only) instead of 16 slots of 2048 tokens and 8 for the peer")
    ap.add_argument("--thin", action="store_true",
                    help="each round also serves the load from thin_server.py: the same "
                         "engine behind the thinnest server, the ceiling for any server here")
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                    help="the streaming clients' library: httpx, or raw (raw_lines: what "
                         "the client's own parsing costs every server)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    CLIENT["library"] = args.client
    ns = [int(x) for x in args.clients.split(",")]
    slots = max(16, max(ns))

    times0 = cpu_times()
    peer_spec = os.environ.get("LLAMA_SERVER")
    raw = RawEngine(slots)
    models = common.slots_file(None if args.defaults else slots)
    others: list[tuple[str, Callable[[], common.Server]]] = []
    if args.thin:
        others.append(("thin", lambda: common.thin(slots, 4096 if args.defaults else 2048)))
    if peer_spec:
        others.append(("peer", lambda: common.peer(peer_spec, None if args.defaults else 8)))
    itl_p50s: list[float] = []  # each N's aotx median inter-token time
    srv: common.Server | None = None
    try:
        srv = common.aotx(models)
        for n in ns:
            rounds: list[dict] = []
            for _ in range(args.rounds):
                # The limit right before the load, in the same minute of this VM's speed.
                decode_only, same_work, prompt_s = raw.measure(n, args.max_tokens, args.requests)
                if srv is None:
                    srv = common.aotx(models)
                rnd = {"limit": {"tok_s": decode_only},
                       "same_work": {"tok_s": same_work, **engine_split(
                           n, args.max_tokens, same_work, prompt_s)},
                       "aotx": asyncio.run(run_load(srv.url, srv.headers, "smollm2", n,
                                                    args.requests, args.max_tokens, 0))}
                for key, start in others:  # one server at a time: A B A B
                    if srv is not None:
                        srv.stop()
                        srv = None
                    other = start()
                    model = "thin" if key == "thin" else "default"  # (what each one serves)
                    try:
                        rnd[key] = asyncio.run(run_load(other.url, {}, model, n, args.requests,
                                                        args.max_tokens, 0))
                    finally:
                        other.stop()
                rounds.append(rnd)
            itl_p50s.append(report(n, rounds, [k for k, _ in others]))
        raw.close()
        if srv is None:
            srv = common.aotx(models)
        base, headers = srv.url, srv.headers
        for n in (8,):
            print(f"native N={n}: admission -> SSE until terminal: "
                  f"{asyncio.run(native_load(base, headers, n, args.max_tokens)):.1f} tok/s",
                  flush=True)
        lat = asyncio.run(admission_latency(base, headers))
        slow = asyncio.run(admission_latency(base, headers, raw=False))
        print(f"admission latency while 8 streams decode: p50 {pct(lat, 50) * 1e3:.2f} ms "
              f"p99 {pct(lat, 99) * 1e3:.2f} ms (n={len(lat)}; with httpx as the client: "
              f"p50 {pct(slow, 50) * 1e3:.2f} ms p99 {pct(slow, 99) * 1e3:.2f} ms)", flush=True)
        rps = asyncio.run(window_reads(base, headers, args.seconds))
        print(f"window reads (GET /aotx/v1/requests/{{id}}, 2 keep-alive connections): "
              f"{rps:.0f} req/s", flush=True)
        print(f"median ITL across N: {statistics.median(itl_p50s) * 1e3:.1f} ms")
        steal = steal_share(times0, cpu_times())
        if steal is not None:
            # A virtual machine whose host is busy loses CPU time to it, and every
            # figure above with it: compare runs only at a similar steal.
            print(f"CPU steal during the run: {100 * steal:.1f} % of the machine's CPU time")
    finally:
        raw.close()
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    main()
