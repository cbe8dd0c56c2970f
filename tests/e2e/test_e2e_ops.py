"""Capabilities, telemetry, metrics and status tell the truth (issue 6)."""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aotx import wire
from aotx.device.models import default_model_path

from ..helpers import Service, running_service
from .test_e2e_foundation import poll_until_terminal
from .test_e2e_grants import mint

MSG = [{"role": "user", "content": "Write a sentence about the sea."}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]


@pytest.fixture(scope="module")
def osvc() -> Iterator[Service]:
    with running_service(extra_args=["--retention-seconds", "2", "--max-active", "6",
                                     "--window-bytes", "64"]) as svc:
        yield svc


def submit(c: httpx.Client, messages=MSG, **kw) -> httpx.Response:
    return c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": messages,
                                             "temperature": 0, **kw})


def sample(c: httpx.Client) -> dict:
    r = c.get("/aotx/v1/telemetry")
    assert r.status_code == 200
    body = r.json()
    assert body["schema"] == "aotx.telemetry.v1" and body["affect"] is None
    assert body["expression"] is None
    return {k: int(v) for k, v in body["sample"].items()}


def test_model_sha256_is_the_hash_of_the_loaded_file(osvc: Service) -> None:
    with osvc.client() as c:
        caps = c.get("/aotx/v1/capabilities").json()
    h = hashlib.sha256()
    with open(default_model_path(), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    (model,) = caps["models"]
    assert model["model_sha256"] == h.hexdigest()
    assert model["alias"] == "smollm2" and model["input_modalities"] == ["text"]
    assert isinstance(model["automatic_memory"], bool) and model["published_at"].endswith("Z")
    assert caps["schema"] == "aotx.capabilities.v1" and "lineage" in caps
    assert caps["features"]["media"] is True and caps["features"]["events"] is True
    assert caps["features"]["shared_operations"] is False  # no route provides ops 10 and 11
    cache = os.path.join(osvc.state_dir, "model-hashes.json")
    assert h.hexdigest() in open(cache).read()  # cached by file identity


def test_allocation_grows_with_results_and_shrinks_when_reclaimed(osvc: Service) -> None:
    with osvc.client() as c:
        time.sleep(3)  # earlier results reclaimed (retention 2 s)
        base = sample(c)["service_allocation_bytes"]
        rid = submit(c, max_tokens=48).json()["id"]
        final = poll_until_terminal(c, rid)
        held = sample(c)["service_allocation_bytes"]
        assert held >= base + int(final["output"]["total_bytes"])
        deadline = time.monotonic() + 30  # reclaimed after its 2 s: a state, not a speed
        while c.get(f"/aotx/v1/requests/{rid}").status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert sample(c)["service_allocation_bytes"] == base


def test_tick_advances_only_while_work_runs(osvc: Service) -> None:
    with osvc.client() as c:
        idle1 = sample(c)
        time.sleep(0.5)
        idle2 = sample(c)
        assert idle2["device_tick"] == idle1["device_tick"]
        assert idle2["device_clock_ns"] > idle1["device_clock_ns"]
        rid = submit(c, max_tokens=16).json()["id"]
        final = poll_until_terminal(c, rid)
        busy = sample(c)
        assert busy["device_tick"] >= idle2["device_tick"] + final["usage"]["completion_tokens"]
        time.sleep(0.5)
        assert sample(c)["device_tick"] == busy["device_tick"]


def test_limits_reported_are_the_limits_enforced(osvc: Service) -> None:
    with osvc.client() as c:
        lim = c.get("/aotx/v1/capabilities").json()["limits"]
        assert lim["max_packet_bytes"] == "65536"
        window = int(lim["window_bytes"])
        assert window == 64
        # window: a long result comes in windows of exactly that many bytes
        rid = submit(c, max_tokens=60).json()["id"]
        final = poll_until_terminal(c, rid)
        assert int(final["output"]["total_bytes"]) > window
        w = c.get(f"/aotx/v1/requests/{rid}").json()["output"]
        assert len(base64.b64decode(w["bytes"])) == window == int(w["next_cursor"])
        # context: the error names the reported limit
        ctx = int(lim["context_tokens"])
        r = submit(c, [{"role": "user", "content": "hello " * ctx}])
        assert r.status_code == 400 and f"at most {ctx - 1}" in r.json()["error"]["message"]
        # output tokens: one over the limit is refused
        out = int(lim["output_tokens"])
        r = submit(c, max_tokens=out + 1)
        assert r.status_code == 400 and str(out) in r.json()["error"]["message"]
        # body: one byte over is 413
        body = int(lim["body_bytes"])
        r = c.post("/aotx/v1/requests", content=b" " * (body + 1),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        # slots and active requests: 6 active allowed, half of them to one principal
        # (--principal-share 0.5), 4 of them run, the 7th is refused
        slots, active = int(lim["slots"]), int(lim["active_requests"])
        assert (slots, active) == (4, 6)
        other = httpx.Client(base_url=osvc.url, timeout=60, headers={
            "Authorization": f"Bearer {mint(osvc, 'ops-other')}"})
        ids = [submit(c, LONG, max_tokens=1000).json()["id"] for _ in range(active // 2)]
        r = submit(c)
        assert r.status_code == 429 and r.json()["error"]["code"] == "active_limit_exceeded"
        assert f"{active // 2} active" in r.json()["error"]["message"]
        theirs = [submit(other, LONG, max_tokens=1000).json()["id"] for _ in range(active // 2)]
        r = submit(httpx.Client(base_url=osvc.url, timeout=60, headers={
            "Authorization": f"Bearer {mint(osvc, 'ops-third')}"}))
        assert r.status_code == 429 and r.json()["error"]["code"] == "service_busy"
        deadline = time.monotonic() + 20
        while True:
            states = [cl.get(f"/aotx/v1/requests/{i}").json()["state"]
                      for cl, rids in ((c, ids), (other, theirs)) for i in rids]
            if states.count("running") == slots:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        assert states.count("queued") == active - slots
        for cl, rids in ((c, ids), (other, theirs)):
            for i in rids:
                cl.post(f"/aotx/v1/requests/{i}/cancel")
            for i in rids:
                poll_until_terminal(cl, i)
        other.close()
    # packets: 65536 bytes pass the broker's decoder, 65537 are refused with 413
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(os.path.join(osvc.state_dir, "run", "service.sock"))
    s.settimeout(10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    s.send(wire.encode_packet(wire.Header(op=wire.Op.INFO, tag=1)) + bytes(wire.MAX_PAYLOAD + 1))
    assert wire.decode_packet(s.recv(wire.MAX_PACKET))[0].status == 413
    s.close()


def test_metrics_in_prometheus_format(osvc: Service) -> None:
    assert httpx.get(osvc.url + "/metrics").status_code == 401
    with osvc.client() as c:
        poll_until_terminal(c, submit(c, max_tokens=8).json()["id"])
        text = c.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("aotx_requests", "aotx_completion_tokens", "aotx_prompt_tokens",
                 "aotx_time_to_first_token_seconds", "aotx_inter_token_seconds",
                 "aotx_queue_depth", "aotx_active_slots", "aotx_mailboxes",
                 "aotx_broker_packets", "aotx_media_bytes"):
        assert name in fams, name
    ttft = {s.name: s.value for s in fams["aotx_time_to_first_token_seconds"].samples}
    assert ttft["aotx_time_to_first_token_seconds_count"] >= 1
    mailboxes = {s.labels["use"]: s.value for s in fams["aotx_mailboxes"].samples}
    assert sum(mailboxes.values()) == 128
    completion = [s.value for s in fams["aotx_completion_tokens"].samples][0]
    assert completion >= 8


def test_health_and_readiness(osvc: Service) -> None:
    assert httpx.get(osvc.url + "/healthz").json() == {"status": "ok"}
    r = httpx.get(osvc.url + "/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_status_command(osvc: Service) -> None:
    r = subprocess.run([sys.executable, "-m", "aotx", "status", "--state-dir", osvc.state_dir],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "runtime epoch 1" in r.stdout and "model smollm2" in r.stdout
    assert "requests:" in r.stdout and "device tick" in r.stdout


def test_telemetry_at_100_hz_from_several_clients(osvc: Service) -> None:
    errors: list[int] = []
    ticks: list[list[int]] = [[], [], []]

    def sampler(k: int, stop: threading.Event) -> None:
        with osvc.client() as c:
            while not stop.is_set():
                r = c.get("/aotx/v1/telemetry")
                if r.status_code != 200:
                    errors.append(r.status_code)
                else:
                    ticks[k].append(int(r.json()["sample"]["device_tick"]))
                time.sleep(0.01)

    stop = threading.Event()
    threads = [threading.Thread(target=sampler, args=(k, stop)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        t0 = time.monotonic()
        with osvc.client() as c:
            final = poll_until_terminal(c, submit(c, max_tokens=32).json()["id"])
        time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))  # at least 2 s of sampling
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert final["state"] == "completed"
    for series in ticks:
        assert len(series) > 20 and series == sorted(series)  # monotonic within the epoch
