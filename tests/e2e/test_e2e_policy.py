"""The resident policy (automatic memory) end to end on the real model (issue 7)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from aotx import wire

from ..helpers import Service, eventually, running_service
from .test_e2e_foundation import poll_until_terminal
from .test_e2e_grants import client, mint

# Which wordings SmolLM2 turns into a fact that memory.decide keeps, at temperature 0,
# follows the build's and the processor's last bits: "... in Paris, where I work as a
# nurse." gives a kept fact on one machine and "Alice, the user has shared a personal
# detail ..." on an AMD EPYC, where "... in Paris. I work as a nurse." gives "Alice is a
# skilled nurse who works in Paris" (elsewhere "... in a hospital", backed too little).
# tell() says them in turn until one is kept (CI's machine's first).
FACTS = ["My name is Alice and I live in Paris. I work as a nurse.",
         "My name is Alice and I live in Paris, where I work as a nurse.",
         "I'm Alice. I live in Paris and I work as a nurse."]
FACT = [{"role": "user", "content": FACTS[1]}]
QUESTION = [{"role": "user", "content": "What do you know about me?"}]
POLICY_ADMIN = "submit,read,cancel,policy-read,policy-control"


def mint_memory(svc: Service, name: str, *args: str) -> str:
    return mint(svc, name, "--memory", *args)


@pytest.fixture(scope="module")
def psvc() -> Iterator[Service]:
    with running_service(env={"AOTX_LOG_PROMPTS": "1"}) as svc:
        yield svc


def ask(c: httpx.Client, messages, **kw) -> str:
    r = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": messages,
                                          "max_tokens": 16, "temperature": 0, **kw})
    assert r.status_code == 202, r.text
    rid = r.json()["id"]
    poll_until_terminal(c, rid)
    return rid


def rendered_prompt(svc: Service, rid: str) -> str:
    """The prompt the device rendered for ``rid`` (logged under AOTX_LOG_PROMPTS=1)."""
    deadline = time.monotonic() + 30  # a line to wait for, not a speed
    while time.monotonic() < deadline:
        for line in svc.read_log().splitlines():
            if f"event=request.prompt id={rid} " in line:
                return line.split(" text=", 1)[1]
        time.sleep(0.1)
    raise AssertionError(f"no prompt logged for {rid}")


def tell(c: httpx.Client, kept: str = "/aotx/v1/memory") -> dict:
    """Say the FACTS in turn until the extraction keeps one: the memory (or, under
    review, the pending decisions at ``kept``) that it gave."""
    for text in FACTS:
        ask(c, [{"role": "user", "content": text}])
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            got = c.get(kept).json()
            if got.get("facts") or got.get("data"):
                return dict(got)
            time.sleep(0.3)
    raise AssertionError("no wording of FACTS gave a fact the policy keeps")


def policy(c: httpx.Client) -> dict:
    r = c.get("/aotx/v1/policy")
    assert r.status_code == 200, r.text
    return r.json()


def control(c: httpx.Client, action: str, revision: str) -> httpx.Response:
    return c.post("/aotx/v1/policy", json={"action": action, "expected_revision": revision})


def test_capabilities_report_the_qualified_role(psvc: Service) -> None:
    with client(psvc, psvc.token) as c:
        caps = c.get("/aotx/v1/capabilities").json()
        assert caps["models"][0]["automatic_memory"] is True
        assert caps["features"]["policy"] is True and caps["lineage"] is not None
        assert c.get("/v1/models").json()["data"][0]["automatic_memory"] is True


def test_memory_is_saved_used_and_private(psvc: Service) -> None:
    alice, bob = mint_memory(psvc, "alice"), mint_memory(psvc, "bob")
    with client(psvc, alice) as a, client(psvc, bob) as b:
        mem = tell(a)
        assert int(mem["generation"]) >= 1
        assert any("Paris" in f or "nurse" in f for f in mem["facts"])
        st = policy_admin(psvc)
        assert int(st["saved_generation"]) >= 1 and int(st["source_frontier"]) >= 1
        # A later request of Alice gets the memory in its context, before the template.
        rid = ask(a, QUESTION)
        prompt = rendered_prompt(psvc, rid)
        assert "Known facts about the user" in prompt and mem["facts"][0] in prompt
        # memory off skips it
        rid_off = ask(a, QUESTION, memory="off")
        assert "Known facts about the user" not in rendered_prompt(psvc, rid_off)
        # Bob never sees it
        rid_bob = ask(b, QUESTION)
        assert "Known facts" not in rendered_prompt(psvc, rid_bob)
        assert b.get("/aotx/v1/memory").json()["facts"] == []
        # The lineage is on disk, checksummed, private
        files = lineage_files(psvc, a)
        assert files and all(os.stat(f).st_mode & 0o077 == 0 for f in files)
        doc = json.load(open(files[-1]))
        assert doc["facts"] == mem["facts"] and len(doc["sha256"]) == 64
        # Erasure removes it from the lineage for real.
        assert a.delete("/aotx/v1/memory").status_code == 204
        assert a.get("/aotx/v1/memory").json()["facts"] == []
        assert lineage_files(psvc, a) == []
        assert "Known facts" not in rendered_prompt(psvc, ask(a, QUESTION, memory="off"))


def lineage_files(svc: Service, c: httpx.Client) -> list[str]:
    root = os.path.join(svc.state_dir, "memory")
    out = []
    for d in os.listdir(root) if os.path.isdir(root) else []:
        for n in sorted(os.listdir(os.path.join(root, d))):
            out.append(os.path.join(root, d, n))
    return out


def policy_admin(svc: Service) -> dict:
    with client(svc, svc.token) as c:
        return policy(c)


def settle(svc: Service, timeout: float = 60) -> dict:
    """Wait until the policy has worked through every source it has."""
    deadline = time.monotonic() + timeout
    last = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        st = policy_admin(svc)
        key = (st["source_frontier"], st["state"], st["active_rows"])
        if key != last:
            last, since = key, time.monotonic()
        elif st["active_rows"] == 0 and time.monotonic() - since > 1.5:
            return st
        time.sleep(0.2)
    raise AssertionError("the policy did not settle")


def test_memory_is_opt_in(psvc: Service) -> None:
    before = int(settle(psvc)["source_frontier"])
    with client(psvc, mint(psvc, "nomem")) as c:  # memory not enabled for this principal
        ask(c, FACT)
        time.sleep(1.5)
        assert c.get("/aotx/v1/memory").json()["facts"] == []
    st = policy_admin(psvc)
    assert int(st["source_frontier"]) == before and st["state"] in ("quiet", "recording")


def test_controls_and_permissions(psvc: Service) -> None:
    with client(psvc, mint(psvc, "carl")) as plain:
        assert plain.get("/aotx/v1/policy").status_code == 403
        assert control(plain, "pause", "1").status_code == 403
    with client(psvc, mint(psvc, "dora", "--actions", "read,policy-read")) as reader:
        assert reader.get("/aotx/v1/policy").status_code == 200
        assert control(reader, "pause", policy(reader)["control_revision"]).status_code == 403
    with client(psvc, mint_memory(psvc, "ops", "--actions", POLICY_ADMIN)) as c:
        rev = policy(c)["control_revision"]
        r = control(c, "pause", rev)
        assert r.status_code == 200 and r.json()["state"] == "paused"
        assert r.json()["reason"] == "paused" and int(r.json()["control_revision"]) == int(rev) + 1
        stale = control(c, "resume", rev)
        assert stale.status_code == 409 and stale.json()["error"]["type"] == "conflict_error"
        # paused: a new source waits, nothing is extracted
        frontier = int(policy(c)["source_frontier"])
        ask(c, [{"role": "user", "content": "I have two cats and I love jazz music."}])
        time.sleep(2)
        assert int(policy(c)["source_frontier"]) == frontier
        r = control(c, "resume", policy(c)["control_revision"])
        assert r.status_code == 200
        deadline = time.monotonic() + 60
        while int(policy(c)["source_frontier"]) == frontier:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = control(c, "stop", policy(c)["control_revision"])
        assert r.json()["state"] == "stopped"
        r = control(c, "resume", policy(c)["control_revision"])
        assert r.json()["state"] in ("quiet", "recording", "active")
        bad = c.post("/aotx/v1/policy", json={"action": "dance", "expected_revision": "1"})
        assert bad.status_code == 400


def test_review_keeps_decisions_pending_until_approved(psvc: Service) -> None:
    with client(psvc, mint_memory(psvc, "rev", "--actions", POLICY_ADMIN)) as c:
        assert control(c, "review-on", policy(c)["control_revision"]).json()["review_enabled"]
        try:
            pending = tell(c, "/aotx/v1/memory/pending")["data"]
            assert policy(c)["state"] == "recording" and policy(c)["pending"] >= 1
            assert c.get("/aotx/v1/memory").json()["facts"] == []  # nothing saved yet
            first = pending[0]
            assert c.post(f"/aotx/v1/memory/pending/{first['id']}/approve").status_code == 200
            assert c.get("/aotx/v1/memory").json()["facts"] == [first["fact"]]
            for p in pending[1:]:
                assert c.post(f"/aotx/v1/memory/pending/{p['id']}/reject").status_code == 200
            assert c.get("/aotx/v1/memory").json()["facts"] == [first["fact"]]
            assert c.post(f"/aotx/v1/memory/pending/{first['id']}/approve").status_code == 404
        finally:
            control(c, "review-off", policy(c)["control_revision"])
    with client(psvc, mint(psvc, "other")) as o:  # another principal cannot decide them
        assert o.get("/aotx/v1/memory/pending").json()["data"] == []


def test_foreground_request_interrupts_policy_work(psvc: Service) -> None:
    with client(psvc, mint_memory(psvc, "fg", "--actions", POLICY_ADMIN)) as c:
        before = policy(c)
        ask(c, [{"role": "user", "content": "My name is Hugo and I live in Lyon. "
                                            "I work as a pilot."}])
        deadline = time.monotonic() + 30
        while policy(c)["state"] != "active":
            assert time.monotonic() < deadline, policy(c)
            time.sleep(0.005)
        r = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": QUESTION,
                                              "max_tokens": 2})
        rid = r.json()["id"]
        deadline = time.monotonic() + 60
        while c.get(f"/aotx/v1/requests/{rid}").json()["usage"]["completion_tokens"] == 0:
            assert time.monotonic() < deadline, policy(c)
            time.sleep(0.005)
        # By its first token, the policy's work had been interrupted for it (once), not
        # run to its end first: counted, rather than timing the first token.
        after = policy(c)
        assert int(after["interrupted"]) == int(before["interrupted"]) + 1
        # the interrupted source is retried once the device is quiet again
        deadline = time.monotonic() + 60
        while int(policy(c)["completed"]) <= int(before["completed"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_lineage_survives_a_device_crash_mid_save(fresh_service: Service) -> None:
    fresh_service.env = {"AOTX_LOG_PROMPTS": "1"}
    fresh_service.start()
    token = mint_memory(fresh_service, "ivan")
    with client(fresh_service, token) as c:
        saved = tell(c)
    (lineage_dir,) = [os.path.join(fresh_service.state_dir, "memory", d)
                      for d in os.listdir(os.path.join(fresh_service.state_dir, "memory"))]
    # A save that a kill -9 interrupted: a partial temporary file and a torn newest file.
    gen = int(saved["generation"])
    with open(os.path.join(lineage_dir, f"gen-{gen + 1:08d}.json.tmp"), "w") as f:
        f.write('{"generation": ')
    with open(os.path.join(lineage_dir, f"gen-{gen + 1:08d}.json"), "w") as f:
        f.write(json.dumps({"generation": gen + 1, "facts": ["torn"], "sha256": "0" * 64}))
    os.kill(fresh_service.children()["device"], signal.SIGKILL)
    def restarted() -> bool:
        with client(fresh_service, token) as c:
            return (c.get("/aotx/v1/memory").status_code == 200
                    and "restart component=device" in fresh_service.read_log()
                    and c.get("/aotx/v1/capabilities").json()["runtime_epoch"] == "2")

    eventually(restarted, timeout=120, interval=0.3)
    with client(fresh_service, token) as c:
        mem = c.get("/aotx/v1/memory").json()
        assert mem["facts"] == saved["facts"] and mem["generation"] == saved["generation"]
        prompt = rendered_prompt(fresh_service, ask(c, QUESTION))
        assert saved["facts"][0] in prompt


def test_policy_status_layout_over_the_socket(psvc: Service) -> None:
    import socket as _s

    s = _s.socket(_s.AF_UNIX, _s.SOCK_SEQPACKET)
    s.connect(os.path.join(psvc.state_dir, "run", "service.sock"))
    s.send(wire.encode_packet(wire.Header(op=wire.Op.POLICY, tag=1, principal=1)))
    h, body = wire.decode_packet(s.recv(wire.MAX_PACKET))
    assert h.status == 200 and len(body) == 160 and body[124:] == bytes(36)
    st = wire.decode_policy_status(body)
    assert st.schema == 1 and st.mode == 1
    # a mutation with a wrong frame epoch is refused
    ctl = wire.encode_policy_control(wire.PolicyControl(
        action=wire.PolicyAction.PAUSE, expected_revision=st.control_revision))
    s.send(wire.encode_packet(wire.Header(op=wire.Op.POLICY, tag=2, principal=1,
                                          epoch=h.epoch + 7), ctl))
    assert wire.decode_packet(s.recv(wire.MAX_PACKET))[0].status == 400
    s.close()
    assert not re.search(r"Alice|Paris", body.decode("latin-1"))
