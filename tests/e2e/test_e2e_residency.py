"""The models' residency through the routes and the CLI (device/residency.py,
gateway/routes_models.py, models_cli.py): each model's state, file size, memory estimate
and SHA-256 in /v1/models; an admin's load and unload, waiting for a running request or
cancelling it; ``aotx models list`` and ``rm``.  SmolLM2 loaded at start, a copy of it
and Gemma 3 loaded on first use, under a budget that holds one of the two."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp
import pytest

from aotx.engine.load import describe

from ..helpers import Service, eventually, gemma_path
from .test_e2e_budget import GEMMA, budgeted, models
from .test_e2e_grants import aotx_cli, client, mint


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    with budgeted(models()) as s:
        yield s


def status(c: httpx.Client, alias: str) -> dict[str, Any]:
    r = c.get(f"/v1/models/{alias}")
    assert r.status_code == 200, r.text
    return dict(r.json()["status"])


def state_is(c: httpx.Client, alias: str, want: str) -> dict[str, Any] | None:
    rows = {m["alias"]: m for m in c.get("/aotx/v1/models").json()["models"]}
    return rows[alias] if rows[alias]["status"]["value"] == want else None


def submit(c: httpx.Client, model: str, max_tokens: int) -> str:
    r = c.post("/aotx/v1/requests", json={
        "model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens, "temperature": 0,
        "logit_bias": {"1": -100, "106": -100}})  # (Gemma's ends banned: it runs to the end)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def request_state(c: httpx.Client, rid: str) -> dict[str, Any]:
    return dict(c.get(f"/aotx/v1/requests/{rid}").json())


def test_every_model_lists_its_state_size_estimate_and_digest(svc: Service) -> None:
    with svc.client() as c:
        listed = {m["id"]: m["status"] for m in c.get("/v1/models").json()["data"]}
        fixed = status(c, "smollm2")
        caps = {m["alias"]: m["status"] for m in c.get("/aotx/v1/capabilities").json()["models"]}
        with open(gemma_path(), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        # hashed in the background after the start: known a moment later
        gemma = eventually(lambda: (lambda s: s if s["sha256"] else None)(status(c, "gemma3")),
                           60)
    assert listed["gemma3"]["value"] == caps["gemma3"]["value"] == "unloaded"
    assert gemma["file_bytes"] == os.path.getsize(gemma_path())
    assert gemma["memory_bytes"] == describe(GEMMA).memory_bytes
    assert gemma["sha256"] == digest and gemma["on_demand"] and gemma["keep_alive"] == 300
    assert fixed["value"] == "loaded" and not fixed["on_demand"] and fixed["keep_alive"] == -1


def test_an_admin_loads_and_unloads_and_others_may_not(svc: Service) -> None:
    bob = mint(svc, "bob-residency")
    with client(svc, bob) as cb:
        refused = cb.post("/aotx/v1/models/gemma3/load")
    assert refused.status_code == 403, refused.text
    with svc.client() as c:
        fixed = c.post("/aotx/v1/models/smollm2/unload")
        assert fixed.status_code == 409 and fixed.json()["error"]["code"] == "model_not_on_demand"
        assert c.post("/aotx/v1/models/nothing/load").status_code == 404
        started = c.post("/aotx/v1/models/gemma3/load")
        assert started.status_code in (200, 202), started.text
        eventually(lambda: state_is(c, "gemma3", "loaded"), 120)
        listed = aotx_cli(svc, "models", "list")
        assert listed.returncode == 0, listed.stderr
        assert any(line.split()[:2] == ["gemma3", "loaded"] for line in listed.stdout.splitlines())
        # an unload waits for the running request, which ends as it would have
        rid = submit(c, "gemma3", 48)
        eventually(lambda: request_state(c, rid)["state"] == "running", 60)
        asked = c.post("/aotx/v1/models/gemma3/unload")
        assert asked.status_code == 202 and asked.json()["unload_asked"], asked.text
        done = eventually(lambda: (lambda b: b if b["state"] == "completed" else None)(
            request_state(c, rid)), 120)
        assert done["usage"]["completion_tokens"] == 48
        eventually(lambda: state_is(c, "gemma3", "unloaded"), 60)


def test_a_token_route_loads_its_model_and_answers(svc: Service) -> None:
    """A dry run (/tokenize) for a model not loaded waits for its load, as a request
    would, and answers with the loaded model's tokenizer."""
    vocab = llama_cpp.Llama(gemma_path(), vocab_only=True, verbose=False)
    try:
        want = list(vocab.tokenize(b"Hello <start_of_turn>", add_bos=False, special=True))
    finally:
        vocab.close()
    with svc.client() as c:
        assert state_is(c, "gemma3", "unloaded") is not None
        r = c.post("/tokenize", json={"model": "gemma3", "content": "Hello <start_of_turn>"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want
        assert state_is(c, "gemma3", "loaded") is not None
        assert c.post("/aotx/v1/models/gemma3/unload").status_code in (200, 202)
        eventually(lambda: state_is(c, "gemma3", "unloaded"), 60)


def test_another_caller_sees_its_own_models_and_no_paths(svc: Service) -> None:
    dave = mint(svc, "dave-residency", "--models", "copy")
    with client(svc, dave) as c:
        doc = c.get("/aotx/v1/models").json()
    assert [m["alias"] for m in doc["models"]] == ["copy"]
    assert doc["unassigned"] is None  # (an admin's list holds the folder's paths)
    copy = doc["models"][0]["status"]
    assert doc["used_bytes"] == (copy["memory_bytes"] if copy["value"] == "loaded" else 0)
    with svc.client() as admin:
        assert admin.get("/aotx/v1/models").json()["unassigned"] == []


def test_an_unload_with_cancel_cancels_the_running_request(svc: Service) -> None:
    with svc.client() as c:
        rid = submit(c, "gemma3", 2000)  # loads it on first use
        eventually(lambda: request_state(c, rid)["state"] == "running", 120)
        asked = c.post("/aotx/v1/models/gemma3/unload", json={"cancel": True})
        assert asked.status_code == 202, asked.text
        ended = eventually(lambda: (lambda b: b if b["state"] == "cancelled" else None)(
            request_state(c, rid)), 60)
        assert ended["usage"]["completion_tokens"] < 2000
        eventually(lambda: state_is(c, "gemma3", "unloaded"), 60)
        assert c.post("/aotx/v1/models/gemma3/unload", json={"cancel": 1}).status_code == 400


def chat(c: httpx.Client, model: str, **more: object) -> httpx.Response:
    return c.post("/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 4, "temperature": 0, **more})


def test_a_requests_keep_alive_holds_the_model_for_its_principal(svc: Service) -> None:
    """Ollama's keep_alive per request: Bob's 0 does not unload the model Alice used a
    moment ago (her request held it for the model's 300 s); once her own request asks
    0 too, it unloads when idle. A principal's -1 is held to the model's keep-alive
    (only an admin may pin), and a keep_alive that is no duration is a 400."""
    alice, bob = mint(svc, "alice-keep"), mint(svc, "bob-keep")
    with client(svc, alice) as ca, client(svc, bob) as cb, svc.client() as admin:
        assert chat(ca, "gemma3").status_code == 200
        assert chat(cb, "gemma3", keep_alive=0).status_code == 200
        time.sleep(2)
        assert state_is(admin, "gemma3", "loaded"), "Bob's keep_alive: 0 unloaded Alice's"
        assert chat(ca, "gemma3", keep_alive="0s").status_code == 200
        eventually(lambda: state_is(admin, "gemma3", "unloaded"), 30)
        assert chat(cb, "gemma3", keep_alive=-1).status_code == 200
        held = eventually(lambda: state_is(admin, "gemma3", "loaded"), 30)
        assert held["status"]["expires_in"] is not None  # not pinned: 300 s at most
        assert held["status"]["expires_in"] <= 300
        bad = chat(cb, "gemma3", keep_alive="soon")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"
        assert chat(admin, "gemma3", keep_alive="-1").status_code == 200  # an admin's pins
        pinned = eventually(lambda: state_is(admin, "gemma3", "loaded"), 30)
        assert pinned["status"]["expires_in"] is None
        assert admin.post("/aotx/v1/models/gemma3/unload").status_code in (200, 202)
        eventually(lambda: state_is(admin, "gemma3", "unloaded"), 30)


def test_the_cli_loads_and_unloads(svc: Service) -> None:
    loaded = aotx_cli(svc, "models", "load", "copy")
    assert loaded.returncode == 0 and loaded.stdout.startswith("copy: "), loaded.stderr
    with svc.client() as c:
        eventually(lambda: state_is(c, "copy", "loaded"), 120)
        unloaded = aotx_cli(svc, "models", "unload", "copy", "--cancel")
        assert unloaded.returncode == 0, unloaded.stderr
        eventually(lambda: state_is(c, "copy", "unloaded"), 60)
    fixed = aotx_cli(svc, "models", "unload", "smollm2")
    assert fixed.returncode == 1 and "409" in fixed.stderr


def test_rm_removes_an_unloaded_unnamed_model_only(svc: Service) -> None:
    mint(svc, "carol-residency", "--models", "copy")
    named = aotx_cli(svc, "models", "rm", "copy")
    assert named.returncode == 1 and "carol-residency" in named.stderr
    with svc.client() as c:
        c.post("/aotx/v1/models/gemma3/load")
        eventually(lambda: state_is(c, "gemma3", "loaded"), 120)
        loaded = aotx_cli(svc, "models", "rm", "gemma3")
        assert loaded.returncode == 1 and "unload it first" in loaded.stderr
        assert c.post("/aotx/v1/models/gemma3/unload").status_code in (200, 202)
        eventually(lambda: state_is(c, "gemma3", "unloaded"), 60)
    path = os.path.join(svc.state_dir, "models", "gemma3.gguf")
    removed = aotx_cli(svc, "models", "rm", "gemma3")
    assert removed.returncode == 0, removed.stderr
    assert not os.path.exists(path) and os.path.exists(gemma_path())  # (a link of its own)
