"""The cheap routes side by side: ``GET /v1/models`` on aotx and on llama-server, both at
their defaults, and aotx's window reads (``GET /aotx/v1/requests/{id}``, through broker and
device) with the same client.

    .venv/bin/python -m bench.bench_routes [--peer PATH/llama-server] [--rounds 4] [--seconds 5]

Both servers stay up, idle, for the whole run; their figures alternate A B A B, one
server loaded at a time (``--seconds`` each).  The client is bench_serve's ``RawHttp``
(a minimal keep-alive HTTP/1.1 client on 2 connections) so that the client library is
not what is measured.  It prints each round's requests per second, the medians, and the
ratios aotx/llama-server per round (models, and window reads against the peer's models).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import statistics
import threading
import time

import httpx
import uvloop

from aotx import wire
from aotx.gateway.broker_client import BrokerClient
from aotx.paths import for_state_dir
from bench import common
from bench.bench_serve import cpu_times, rate, steal_share


def rate_http_client(base: str, headers: dict[str, str], path: str, seconds: float) -> float:
    """The same with the standard library's ``http.client`` (the issue's client), 2
    keep-alive connections on 2 threads."""
    host, port = base.split("//")[1].split(":")
    counts = [0, 0]
    end = time.perf_counter() + seconds

    def conn(k: int) -> None:
        c = http.client.HTTPConnection(host, int(port))
        while time.perf_counter() < end:
            c.request("GET", path, headers=headers)
            r = c.getresponse()
            body = r.read()
            assert r.status == 200, body[:200]
            counts[k] += 1
        c.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=conn, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


async def round_trips(state_dir: str, seconds: float) -> float:
    """INFO packets per second through the broker to the device and back, on the gateway's
    own client (2 calls in flight, no HTTP): the most window reads could reach, since each
    crosses the broker and the device, where the results and their grants live."""
    broker = BrokerClient(for_state_dir(state_dir).socket)
    count = 0
    end = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal count
        while time.perf_counter() < end:
            h, _ = await broker.call(wire.Header(op=wire.Op.INFO))
            assert h.status == 200, h
            count += 1

    t0 = time.perf_counter()
    await asyncio.gather(caller(), caller())
    rate = count / (time.perf_counter() - t0)
    await broker.close()
    return rate


def completed_request(base: str, headers: dict[str, str]) -> str:
    with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
        rid = str(c.post("/aotx/v1/requests", json={
            "model": "smollm2", "max_tokens": 32,
            "messages": [{"role": "user", "content": "Say something."}]}).json()["id"])
        while c.get(f"/aotx/v1/requests/{rid}").json()["state"] != "completed":
            time.sleep(0.05)
    return rid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", default=os.environ.get("LLAMA_SERVER", ""))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    times0 = cpu_times()
    peer: common.Server | None = None
    rows: list[dict[str, float]] = []
    with common.serving("") as svc:
        try:
            if args.peer:
                peer = common.peer(args.peer)  # at its defaults
            rid = completed_request(svc.url, svc.headers)
            targets = [("models", svc.url, svc.headers, "/v1/models"),
                       ("window", svc.url, svc.headers, f"/aotx/v1/requests/{rid}")]
            if peer is not None:
                targets.insert(1, ("peer", peer.url, {"Authorization": "Bearer none"},
                                   "/v1/models"))
            for r in range(args.rounds):
                row: dict[str, float] = {}
                for client in ("raw", "http.client"):
                    for key, base, headers, path in targets:
                        row[f"{key} {client}"] = (
                            asyncio.run(rate(base, headers, path, args.seconds)) if client == "raw"
                            else rate_http_client(base, headers, path, args.seconds))
                row["mailbox"] = uvloop.run(round_trips(svc.state, args.seconds))
                rows.append(row)
                print(f"round {r + 1}: " + "  ".join(f"{k} {v:.0f}" for k, v in row.items()),
                      flush=True)
        finally:
            if peer is not None:
                peer.stop()

    for client in ("raw", "http.client"):
        def med(key: str, client: str = client) -> float:
            return statistics.median(x[f"{key} {client}"] for x in rows)

        print(f"client {client} (median of {len(rows)} rounds): GET /v1/models {med('models'):.0f} "
              f"req/s, window reads {med('window'):.0f} req/s"
              + (f", llama-server's GET /v1/models {med('peer'):.0f} req/s" if peer else ""))
        if peer is not None:
            for key, name in (("models", "/v1/models"), ("window", "window reads")):
                each = [x[f"{key} {client}"] / x[f"peer {client}"] for x in rows]
                print(f"  {name} / llama-server's /v1/models: {statistics.median(each):.2f} "
                      f"[{'/'.join(f'{e:.2f}' for e in each)}]")
    mailbox = statistics.median(x["mailbox"] for x in rows)
    print(f"device round trips (INFO through the broker, no HTTP, 2 in flight): {mailbox:.0f}/s"
          + (f", {mailbox / statistics.median(x['peer raw'] for x in rows):.2f} x llama-server's "
             "GET /v1/models (raw client)" if peer else ""))
    steal = steal_share(times0, cpu_times())
    if steal is not None:
        print(f"CPU steal during the run: {100 * steal:.1f} % of the machine's CPU time")


if __name__ == "__main__":
    main()
