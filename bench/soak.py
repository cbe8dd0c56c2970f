"""A bounded soak of mixed clients against a real ``aotx serve`` on 127.0.0.1.

    .venv/bin/python -m bench.soak --seconds 600 --workers 8

Each worker loops over four kinds of client until the time is up, and checks
every byte it received against the request's final windows:

* native: submit, poll windows until terminal, reassemble;
* events: submit, follow SSE, drop the connection at a random point, resume with
  Last-Event-ID (or ?cursor), reassemble;
* standard: a streaming chat completion, sometimes aborted by the client (the
  device must then report the request cancelled), else compared to the windows;
* cancel: submit a long request and cancel it (terminal state must be cancelled
  or completed).

Beside them runs a **hostile principal** (its own token, the default grant): it
floods admissions until its share is full, opens event streams on its queued
requests and drops them at once, fills its share of the media pool, floods
embeddings (2,048 tokens a call from two tasks), and sends schema-constrained chat
completions: a schema of an ``anyOf`` of 500 patterns (costly masks) and a pattern
no matcher can hold (refused at admission).  The
well-behaved workers must not notice: any error they see fails the soak.  At the
end the hostile token is revoked (which cancels its requests) and its sources
removed.

It prints requests served, errors by status, latency p50/p99 per kind, what the
hostile principal got, and the device's service allocation and the processes'
RSS at start and at the end, after results were reclaimed
(``--retention-seconds`` is short).  It exits 1 on any byte mismatch, any
error a well-behaved worker saw, or allocation growth.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from bench import common

KINDS = ("native", "events", "standard", "cancel")
TOPICS = ["a cat", "the sea", "a robot", "Paris", "a storm", "music", "a garden", "trains"]


@dataclass
class Report:
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    latency: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    mismatches: list[str] = field(default_factory=list)
    hostile: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class Until:
    """Whether the soak goes on: until ``seconds`` have passed *and* the workers were
    served each kind of client ``each`` times, never past ``cap`` seconds.  A slow or
    loaded machine runs longer rather than testing less, so counts can be asserted.
    """

    report: Report
    end: float
    cap: float
    each: int = 0

    def __call__(self) -> bool:
        now = time.monotonic()
        short = any(self.report.served[k] < self.each for k in KINDS)
        return now < self.end or (short and now < self.cap)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def windows(c: httpx.AsyncClient, rid: str) -> tuple[bytes, dict]:
    out, cursor = b"", 0
    while True:
        r = await c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(cursor)})
        r.raise_for_status()
        doc = r.json()
        out += base64.b64decode(doc["output"]["bytes"])
        cursor = int(doc["output"]["next_cursor"])
        if cursor == int(doc["output"]["total_bytes"]):
            return out, doc


async def until_terminal(c: httpx.AsyncClient, rid: str) -> dict:
    while True:
        doc = (await c.get(f"/aotx/v1/requests/{rid}")).json()
        if doc["state"] in ("completed", "failed", "cancelled"):
            return doc
        await asyncio.sleep(0.05)


async def submit(c: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> str:
    r = await c.post("/aotx/v1/requests", json={
        "model": "smollm2", "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7]),
        "messages": [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}]})
    if r.status_code != 202:
        raise httpx.HTTPStatusError(str(r.status_code), request=r.request, response=r)
    return str(r.json()["id"])


async def follow(c: httpx.AsyncClient, rid: str, rng: random.Random) -> bytes:
    got, last, cursor = b"", None, None
    drops = rng.randint(0, 2)
    while True:
        headers: dict[str, str] = {"Last-Event-ID": last} if last and rng.random() < 0.5 else {}
        params: dict[str, str] = {"cursor": str(cursor)} if cursor is not None and not headers else {}
        async with c.stream("GET", f"/aotx/v1/requests/{rid}/events", headers=headers,
                            params=params) as r:
            r.raise_for_status()
            event, done = {}, False
            async for line in r.aiter_lines():
                if line.startswith(":"):
                    continue
                if line:
                    k, _, v = line.partition(": ")
                    event[k] = v
                    continue
                if event.get("event") == "emission":
                    em = json.loads(event["data"])
                    if int(em["offset"]) != len(got):
                        raise AssertionError(f"emission at {em['offset']}, expected {len(got)}")
                    got += base64.b64decode(em["bytes"])
                    last, cursor = event["id"], int(em["next_cursor"])
                    if drops and rng.random() < 0.2:
                        drops -= 1
                        break  # drop the connection mid-stream, then resume
                elif event.get("event") == "status" and json.loads(event["data"])["state"] in (
                        "completed", "failed", "cancelled"):
                    done = True
                event = {}
            if done:
                return got


async def worker(base: str, headers: dict[str, str], running: Until, seed: int,
                 report: Report) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as c:
        while running():
            kind = rng.choice(KINDS)
            t0 = time.monotonic()
            try:
                if kind == "native":
                    rid = await submit(c, rng, rng.randint(4, 48))
                    await until_terminal(c, rid)
                    await windows(c, rid)
                elif kind == "events":
                    rid = await submit(c, rng, rng.randint(8, 64))
                    got = await follow(c, rid, rng)
                    full, _ = await windows(c, rid)
                    if got != full:
                        report.mismatches.append(f"events {rid}: {len(got)} != {len(full)}")
                elif kind == "standard":
                    abort = rng.random() < 0.4
                    body = {"model": "smollm2", "stream": True, "max_tokens": 64,
                            "temperature": 0,
                            "messages": [{"role": "user", "content": "Write a poem."}]}
                    text, n = "", 0
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        rid = r.headers["x-request-id"]
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                obj = json.loads(line[6:])
                                for ch in obj.get("choices") or []:
                                    text += ch["delta"].get("content") or ""
                                n += 1
                                if abort and n >= 3:
                                    break
                    final = await until_terminal(c, rid)
                    full, _ = await windows(c, rid)
                    if abort and final["state"] == "running":
                        report.mismatches.append(f"standard {rid}: still running after abort")
                    if not abort and text != full.decode("utf-8"):
                        report.mismatches.append(f"standard {rid}: text differs from windows")
                else:
                    rid = await submit(c, rng, 400)
                    await asyncio.sleep(rng.random() * 0.5)
                    r = await c.post(f"/aotx/v1/requests/{rid}/cancel")
                    if r.status_code != 202:
                        report.errors[f"cancel {r.status_code}"] += 1
                    final = await until_terminal(c, rid)
                    if final["state"] not in ("cancelled", "completed"):
                        report.mismatches.append(f"cancel {rid}: {final['state']}")
                report.served[kind] += 1
                report.latency[kind].append(time.monotonic() - t0)
            except httpx.HTTPStatusError as exc:
                report.errors[f"{kind} {exc.response.status_code}"] += 1
            except (httpx.HTTPError, AssertionError, KeyError, ValueError) as exc:
                report.errors[f"{kind} {type(exc).__name__}"] += 1


async def flood(c: httpx.AsyncClient, running: Until, rng: random.Random, ids: list[str],
                report: Report) -> None:
    """Admit requests as fast as the share allows (a 429 waits a little)."""
    while running():
        r = await c.post("/aotx/v1/requests", json={
            "model": "smollm2", "max_tokens": rng.randint(8, 48), "temperature": 0.8,
            "messages": [{"role": "user", "content": f"Tell a story about {rng.random()}"}]})
        report.hostile[f"submit {r.status_code}"] += 1
        if r.status_code == 202:
            ids.append(r.json()["id"])
        else:
            await asyncio.sleep(1.0)


async def drop_streams(c: httpx.AsyncClient, running: Until, rng: random.Random,
                       ids: list[str], report: Report) -> None:
    """Open event streams on its own requests and close them at once."""
    while running():
        if not ids:
            await asyncio.sleep(0.1)
            continue
        try:
            async with c.stream("GET", f"/aotx/v1/requests/{rng.choice(ids)}/events") as r:
                report.hostile[f"events {r.status_code}"] += 1
                async for _ in r.aiter_lines():
                    break
        except httpx.HTTPError as exc:
            report.hostile[f"events {type(exc).__name__}"] += 1
        await asyncio.sleep(0.1)  # ~20 drops a second: 128 mailboxes held 10 s each went in 7 s


async def hog_media(c: httpx.AsyncClient, running: Until, report: Report) -> None:
    """Upload 1 MiB sources until refused, hold them 2 s, remove them all, and again."""
    held: list[str] = []
    while running():
        blob = b"\x89PNG\r\n\x1a\n" + os.urandom(1 << 20)
        r = await c.post("/aotx/v1/media", content=blob, headers={"Content-Type": "image/png"})
        report.hostile[f"media {r.status_code}"] += 1
        if r.status_code == 201:
            held.append(r.json()["id"])
            continue
        await asyncio.sleep(2.0)  # hold the full share a while, then give it back
        for sid in held:
            await c.delete(f"/aotx/v1/media/{sid}")
        held.clear()
    for sid in held:
        await c.delete(f"/aotx/v1/media/{sid}")


FLOOD_EMBED = {"model": "smollm2", "input": [[100 + i for i in range(512)]] * 4}
HEAVY_SCHEMA = {"type": "object", "required": ["v"], "additionalProperties": False,
                "properties": {"v": {"anyOf": [{"type": "string",
                                                "pattern": f"^w{i:03d}[a-z]{{0,8}}$"}
                                               for i in range(500)]}}}
UNMATCHABLE = {"type": "string", "pattern": "^(x{1000}){1000}$"}


async def flood_embeddings(c: httpx.AsyncClient, running: Until, report: Report) -> None:
    """Embed 2,048 tokens a call, again and again (a 429, its turn not come: wait)."""
    while running():
        r = await c.post("/v1/embeddings", json=FLOOD_EMBED)
        report.hostile[f"embed {r.status_code}"] += 1
        if r.status_code != 200:
            await asyncio.sleep(0.5)


async def constrained(c: httpx.AsyncClient, running: Until, report: Report) -> None:
    """Chat completions under a costly schema, and under one no matcher can hold."""
    while running():
        for schema in (HEAVY_SCHEMA, UNMATCHABLE):
            r = await c.post("/v1/chat/completions", json={
                "model": "smollm2", "max_tokens": 32,
                "messages": [{"role": "user", "content": "Pick a word."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}}})
            report.hostile[f"schema {r.status_code}"] += 1


async def hostile(base: str, token: str, running: Until, seed: int, report: Report) -> None:
    rng = random.Random(seed)
    ids: list[str] = []
    async with httpx.AsyncClient(base_url=base, timeout=120,
                                 headers={"Authorization": f"Bearer {token}"}) as c:
        await asyncio.gather(*(flood(c, running, rng, ids, report) for _ in range(4)),
                             *(drop_streams(c, running, rng, ids, report) for _ in range(2)),
                             hog_media(c, running, report),
                             *(flood_embeddings(c, running, report) for _ in range(2)),
                             *(constrained(c, running, report) for _ in range(2)))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def components(state: str) -> dict[str, int]:
    out = {}
    for comp in ("device", "broker", "gateway"):
        r = subprocess.run(["pgrep", "-f", f"{comp} --state-dir {state}"],
                           capture_output=True, text=True)
        if r.stdout.split():
            out[comp] = int(r.stdout.split()[0])
    return out


async def allocation(base: str, headers: dict[str, str]) -> int:
    async with httpx.AsyncClient(base_url=base, headers=headers) as c:
        r = await c.get("/aotx/v1/telemetry")
        return int(r.json()["sample"]["service_allocation_bytes"])


async def soak(base: str, headers: dict[str, str], seconds: float, workers: int,
               seed: int, hostile_token: str | None = None, each: int = 0) -> Report:
    report = Report()
    now = time.monotonic()
    running = Until(report, now + seconds, now + max(4 * seconds, 300), each)
    bad = [hostile(base, hostile_token, running, seed + 1000, report)] if hostile_token else []
    await asyncio.gather(*(worker(base, headers, running, seed + k, report) for k in range(workers)),
                         *bad)
    return report


def revoke(srv: common.Server, principal: str) -> None:
    """Revoke the principal's tokens: the device cancels its requests."""
    for line in srv.cli("token", "list").splitlines():
        tid, who, live = line.split("\t")
        if who == principal and live == "live":
            srv.cli("token", "revoke", tid)


def start(retention: int) -> common.Server:
    # small pools, so the hostile principal reaches its shares within seconds (64
    # requests, 32 MiB of media)
    return common.aotx("[default]\nslots = 8\ncontext = 2048\n",
                       args=["--retention-seconds", str(retention), "--max-active", "128",
                             "--media-pool-bytes", str(64 << 20)])


def run(seconds: float, workers: int, seed: int = 1, retention: int = 3,
        with_hostile: bool = True, each: int = 0) -> tuple[Report, dict]:
    """Soak for ``seconds``, longer until each kind of client was served ``each`` times."""
    srv = start(retention)
    base, headers, state = srv.url, srv.headers, srv.state
    try:
        pids = components(state)
        token = srv.mint("hostile") if with_hostile else None
        alloc0 = asyncio.run(allocation(base, headers))
        rss0 = {k: rss_kib(p) for k, p in pids.items()}
        t0 = time.monotonic()
        report = asyncio.run(soak(base, headers, seconds, workers, seed, token, each))
        wall = time.monotonic() - t0
        if with_hostile:
            revoke(srv, "hostile")
        time.sleep(retention + 2.5)  # every result reclaimed
        alloc1 = asyncio.run(allocation(base, headers))
        rss1 = {k: rss_kib(p) for k, p in pids.items()}
        return report, {"alloc0": alloc0, "alloc1": alloc1, "rss0": rss0, "rss1": rss1,
                        "wall": wall}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-hostile", action="store_true", help="without the hostile principal")
    args = ap.parse_args()
    report, m = run(args.seconds, args.workers, args.seed, with_hostile=not args.no_hostile)
    total = sum(report.served.values())
    print(f"served {total} requests in {m['wall']:.0f} s: {dict(report.served)}")
    print(f"errors: {dict(report.errors) or 'none'}")
    for kind, xs in sorted(report.latency.items()):
        print(f"  {kind:8s} p50 {pct(xs, 50) * 1e3:7.1f} ms  p99 {pct(xs, 99) * 1e3:7.1f} ms")
    print(f"hostile principal: {dict(report.hostile) or 'absent'}")
    print(f"service allocation: {m['alloc0']} bytes at start, {m['alloc1']} after reclaim")
    print(f"RSS KiB at start {m['rss0']}, at end {m['rss1']}")
    print(f"byte mismatches: {len(report.mismatches)}")
    for line in report.mismatches[:10]:
        print("  ", line)
    bad = report.mismatches or m["alloc1"] != m["alloc0"] or report.errors
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
