"""Credentials and grants, end to end: principals isolated where the results live (issue 4)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from aotx import wire
from aotx.gateway.credentials import token_hash

from ..helpers import Service, eventually, running_service
from .test_e2e_foundation import poll_until_terminal

MSG = [{"role": "user", "content": "Say hello."}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]


def aotx_cli(svc: Service, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aotx", *args, "--state-dir", svc.state_dir],
                          capture_output=True, text=True, timeout=60)


def mint(svc: Service, principal: str, *args: str) -> str:
    r = aotx_cli(svc, "token", "create", "--principal", principal, *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def client(svc: Service, token: str) -> httpx.Client:
    return httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"},
                        timeout=60)


def submit(c: httpx.Client, messages=MSG, **kw) -> httpx.Response:
    return c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": messages,
                                             "max_tokens": 8, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def gsvc() -> Iterator[Service]:
    with running_service() as svc:
        yield svc


def test_principals_cannot_touch_each_others_requests(gsvc: Service) -> None:
    alice, bob = mint(gsvc, "alice"), mint(gsvc, "bob")
    with client(gsvc, alice) as a, client(gsvc, bob) as b:
        rid = submit(a).json()["id"]
        poll_until_terminal(a, rid)
        assert a.get(f"/aotx/v1/requests/{rid}").status_code == 200
        epoch = rid[4:20]
        unknown = f"req-{epoch}-{'cd' * 16}"
        for path, method in ((f"/aotx/v1/requests/{rid}", "GET"),
                             (f"/aotx/v1/requests/{rid}/events", "GET"),
                             (f"/aotx/v1/requests/{rid}/cancel", "POST")):
            foreign = b.request(method, path)
            missing = b.request(method, path.replace(rid, unknown))
            assert foreign.status_code == 404 == missing.status_code
            # never a hint that the id exists: the same answer as for an unknown id
            assert foreign.json() == missing.json()
        assert a.get(f"/aotx/v1/requests/{rid}").json()["state"] == "completed"


def test_revoked_token_is_refused_at_once(gsvc: Service) -> None:
    token = mint(gsvc, "carol")
    with client(gsvc, token) as c:
        assert c.get("/v1/models").status_code == 200
        listing = aotx_cli(gsvc, "token", "list").stdout
        tid = [ln.split("\t")[0] for ln in listing.splitlines() if "\tcarol\t" in ln][-1]
        assert token not in listing
        assert aotx_cli(gsvc, "token", "revoke", tid).returncode == 0
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_replaced_grant_hides_results_of_the_old_revision(gsvc: Service) -> None:
    old = mint(gsvc, "dave")
    with client(gsvc, old) as c:
        rid = submit(c).json()["id"]
        poll_until_terminal(c, rid)
    new = mint(gsvc, "dave", "--actions", "submit,read,cancel,telemetry")
    for token in (old, new):
        with client(gsvc, token) as c:
            assert c.get(f"/aotx/v1/requests/{rid}").status_code == 404
    with client(gsvc, new) as c:  # the new revision works for new requests
        rid2 = submit(c).json()["id"]
        assert poll_until_terminal(c, rid2)["state"] == "completed"
        assert c.get("/aotx/v1/telemetry").status_code == 200


def test_active_request_limit_answers_429_and_releases(gsvc: Service) -> None:
    with client(gsvc, mint(gsvc, "erin", "--limit", "active=1")) as c:
        first = submit(c, LONG, max_tokens=1500).json()["id"]
        r = submit(c)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        c.post(f"/aotx/v1/requests/{first}/cancel")
        poll_until_terminal(c, first)
        assert submit(c).status_code == 202


def test_input_output_and_rate_limits(gsvc: Service) -> None:
    with client(gsvc, mint(gsvc, "fay", "--limit", "input_bytes=200", "--limit",
                           "output_tokens=5")) as c:
        r = submit(c, [{"role": "user", "content": "x" * 300}])
        assert r.status_code == 413
        r = submit(c, max_tokens=10)
        assert r.status_code == 400 and "exceeds the limit of 5" in r.json()["error"]["message"]
        r = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": LONG})
        assert r.status_code == 202
        final = poll_until_terminal(c, r.json()["id"])
        assert final["usage"]["completion_tokens"] <= 5  # unspecified max_tokens is clamped
    with client(gsvc, mint(gsvc, "gus", "--limit", "rate=2")) as c:
        assert submit(c).status_code == 202
        assert submit(c).status_code == 202
        r = submit(c)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 1


def test_missing_action_answers_403(gsvc: Service) -> None:
    with client(gsvc, mint(gsvc, "hal", "--actions", "submit")) as c:
        rid = submit(c).json()["id"]
        for method, path in (("GET", f"/aotx/v1/requests/{rid}"),
                             ("POST", f"/aotx/v1/requests/{rid}/cancel"),
                             ("GET", "/aotx/v1/telemetry")):
            r = c.request(method, path)
            assert r.status_code == 403, path
            assert r.json()["error"]["type"] == "permission_error"
    with client(gsvc, mint(gsvc, "ivy", "--actions", "read")) as c:
        assert submit(c).status_code == 403


def test_a_principal_sees_only_its_models(gsvc: Service) -> None:
    with client(gsvc, mint(gsvc, "jon", "--models", "other-model")) as c:
        assert c.get("/v1/models").json()["data"] == []
        assert c.get("/v1/models/smollm2").status_code == 404
        assert c.get("/aotx/v1/capabilities").json()["models"] == []
        assert submit(c).status_code == 404
        r = c.post("/v1/chat/completions", json={"model": "smollm2", "messages": MSG})
        assert r.status_code == 404


def test_credentials_are_stored_hashed_and_private(gsvc: Service) -> None:
    token = mint(gsvc, "kim")
    db = os.path.join(gsvc.state_dir, "aotx.db")
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    blob = b""
    for suffix in ("", "-wal"):
        if os.path.exists(db + suffix):
            with open(db + suffix, "rb") as f:
                blob += f.read()
    assert token.encode() not in blob and token_hash(token) in blob
    assert token not in gsvc.read_log()
    # The device's grant rows carry no token and no hash.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(os.path.join(gsvc.state_dir, "run", "service.sock"))
    s.send(wire.encode_packet(wire.Header(op=wire.Op.GRANT_READ, tag=1)))
    h, body = wire.decode_packet(s.recv(wire.MAX_PACKET))
    s.close()
    rows = wire.decode_grants(body, h.total)
    assert len(rows) >= 2 and len(body) == 64 * len(rows)
    assert token_hash(token) not in body and token.encode() not in body


def test_restart_keeps_tokens_and_reinstalls_grants(fresh_service: Service) -> None:
    fresh_service.start()
    token = mint(fresh_service, "liz", "--actions", "submit,read,telemetry")
    with client(fresh_service, token) as c:
        assert c.get("/aotx/v1/telemetry").status_code == 200
    fresh_service.stop()
    fresh_service.start()
    with client(fresh_service, token) as c:
        rid = submit(c).json()["id"]
        assert poll_until_terminal(c, rid)["state"] == "completed"
        assert c.get("/aotx/v1/telemetry").status_code == 200
        assert c.post(f"/aotx/v1/requests/{rid}/cancel").status_code == 403
    shown = aotx_cli(fresh_service, "grant", "show").stdout
    assert "liz" in shown and "device (epoch 2)" in shown


def test_token_cli_rejects_bad_input(gsvc: Service) -> None:
    r = aotx_cli(gsvc, "token", "create", "--principal", "x", "--actions", "fly")
    assert r.returncode == 2 and "unknown action" in r.stderr
    r = aotx_cli(gsvc, "token", "create", "--principal", "x", "--limit", "speed=3")
    assert r.returncode == 2 and "bad limit" in r.stderr
    r = aotx_cli(gsvc, "token", "create", "--principal", "x", "--limit", "active=0")
    assert r.returncode == 2 and "1 or more" in r.stderr  # 0 would be no limit at all
    r = aotx_cli(gsvc, "token", "create", "--principal", "x", "--models", " , ")
    assert r.returncode == 2 and "at least one model" in r.stderr  # not every model
    r = aotx_cli(gsvc, "token", "create", "--principal", "admin", "--actions", "read")
    assert r.returncode == 2 and "own principal" in r.stderr  # the admin token keeps its grant
    shown = aotx_cli(gsvc, "grant", "show").stdout.splitlines()
    assert not any(line.startswith("x\t") for line in shown)  # nothing was created
    admin = next(line for line in shown if line.startswith("admin\t"))
    assert "telemetry" in admin.split("\t")[2]  # still every action
    mint(gsvc, "remembered", "--memory")  # grant show says who takes part in memory
    shown = aotx_cli(gsvc, "grant", "show").stdout.splitlines()
    assert shown[0].split("\t")[5] == "memory"
    rows = {line.split("\t")[0]: line.split("\t") for line in shown[1:] if "\t" in line}
    assert (rows["remembered"][5], rows["admin"][5]) == ("on", "off")
    assert aotx_cli(gsvc, "token", "revoke", "99999").returncode == 1


def test_grant_changes_apply_within_a_second_without_requests(gsvc: Service) -> None:
    """A changed grant reaches the device with no request to carry it: the gateway's poll
    loop (every 0.5 s) installs it.  Without the poll it would wait for the next request
    forever, so the wait below is for a state, and generous: each look is an ``aotx``
    process of its own (about a second on a loaded machine), and the speed of the
    machine is not what is tested."""
    token = mint(gsvc, "max")
    mint(gsvc, "max", "--actions", "submit,read,cancel,media,telemetry")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = aotx_cli(gsvc, "grant", "show").stdout
        device = shown.split("device (epoch")[1]
        rows = [ln.split("\t") for ln in device.splitlines()[2:] if ln]
        pid = [ln.split("\t")[1] for ln in shown.splitlines() if ln.startswith("max\t")][0]
        mine = [r for r in rows if r[0] == pid]
        if mine and "telemetry" in mine[0][2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("grant change not installed on the device")
    del token


def test_gateway_restart_keeps_results_readable(fresh_service: Service) -> None:
    """A gateway restart must not reinstall grants with new revisions (that would hide results)."""
    import signal

    fresh_service.start()
    token = mint(fresh_service, "nia")
    with client(fresh_service, token) as c:
        rid = submit(c).json()["id"]
        poll_until_terminal(c, rid)
        before = c.get(f"/aotx/v1/requests/{rid}").json()
    os.kill(fresh_service.children()["gateway"], signal.SIGKILL)
    def answered() -> httpx.Response | None:
        r = httpx.get(fresh_service.url + f"/aotx/v1/requests/{rid}",
                      headers={"Authorization": f"Bearer {token}"}, timeout=5)
        return r if r.status_code != 503 else None

    r = eventually(answered, timeout=30)
    assert "event=serve.restart component=gateway" in fresh_service.read_log()
    assert r.status_code == 200 and r.json()["output"] == before["output"]
    with client(fresh_service, fresh_service.token) as c:  # the admin too
        assert c.get("/v1/models").status_code == 200
