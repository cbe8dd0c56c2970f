"""Models loaded on first use from the models folder (device/ondemand.py): the embedded
SmolLM2 serves from the start; Gemma 3 and a copy of SmolLM2 sit in STATE/models."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest

from aotx.device.models import default_model_path

from ..helpers import (
    GEMMA_TEMPLATE,
    SMALL_MODELS,
    Service,
    eventually,
    gemma_path,
    running_service,
)

MODELS = SMALL_MODELS + f'''
[[model]]
alias = "gemma3"
path = "models/gemma3/gemma-3-270m-q4_k_m.gguf"
chat_template = "{GEMMA_TEMPLATE}"
slots = 2
context = 2048
on_demand = true
'''


def place(src: str, dst: str) -> None:
    """A file of its own (not a symlink: its real path would be the declared model's),
    hard-linked where the filesystem allows."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def folder(state: str) -> None:
    models = os.path.join(state, "models")
    os.makedirs(os.path.join(models, "gemma3"))
    place(gemma_path(), os.path.join(models, "gemma3", "gemma-3-270m-q4_k_m.gguf"))
    place(default_model_path(), os.path.join(models, "copy.gguf"))  # found: on demand
    with open(os.path.join(models, "broken.gguf"), "wb") as f:
        f.write(b"GGUF" + b"\0" * 64)


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    with running_service(folder, models=MODELS) as s:
        yield s


def metric(svc: Service, name: str, alias: str, more: str = "") -> float:
    with svc.client() as c:
        text = c.get("/metrics").text
    labels = f'model="{alias}"' + (f",{more}" if more else "")
    found = re.search(rf'^{name}{{{labels}}} ([0-9.e+]+)$', text, re.M)
    return float(found[1]) if found else 0.0


def chat(svc: Service, model: str, content: str = "Name a colour.") -> str:
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0,
                           timeout=300)
    r = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": content}])
    return r.choices[0].message.content or ""


def test_every_model_is_listed_before_it_is_loaded(svc: Service) -> None:
    with svc.client() as c:
        listed = {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert {"smollm2", "gemma3", "copy", "broken"} <= listed
    assert metric(svc, "aotx_model_state", "gemma3", 'state="unloaded"') == 1.0
    assert metric(svc, "aotx_model_memory_bytes", "gemma3") > 246_000_000  # its weights+


def test_concurrent_first_requests_load_once_and_answer_as_the_loaded_model(
        svc: Service) -> None:
    reference = chat(svc, "smollm2")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(svc, "copy"), range(4)))
    assert answers == [reference] * 4  # the same file, greedy
    assert metric(svc, "aotx_model_loads_total", "copy") == 1.0

    def caps() -> dict[str, dict[str, object]] | None:
        with svc.client() as c:
            rows = {m["alias"]: m for m in c.get("/aotx/v1/capabilities").json()["models"]}
        # (the description's row says embeddings too: wait for the loaded model's digest)
        return rows if rows["copy"]["model_sha256"] != "00" * 32 else None

    # once loaded, the gateway lists the loaded model's own row (the same file's digest)
    # and its embeddings answer
    rows = eventually(caps, 30)
    assert rows["copy"]["model_sha256"] == rows["smollm2"]["model_sha256"]
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0)
    vectors = [client.embeddings.create(model=m, input="a colour").data[0].embedding
               for m in ("smollm2", "copy")]
    assert len(vectors[0]) == 576 and vectors[0] == pytest.approx(vectors[1], abs=1e-4)


def test_a_request_waits_in_preparing_on_the_native_route(svc: Service) -> None:
    with svc.client() as c:
        r = c.post("/aotx/v1/requests", json={
            "model": "gemma3", "messages": [{"role": "user", "content": "Hello."}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        first = c.get(f"/aotx/v1/requests/{rid}").json()
        # Gemma's load takes a second on this machine: the request is seen waiting for it
        assert first["state"] == "preparing", first
        done = eventually(lambda: (lambda b: b if b["state"] in ("completed", "failed")
                                   else None)(c.get(f"/aotx/v1/requests/{rid}").json()), 300)
    assert done["state"] == "completed" and done["usage"]["completion_tokens"] == 4, done
    assert metric(svc, "aotx_model_state", "gemma3", 'state="loaded"') == 1.0


def test_a_broken_file_fails_its_requests_and_the_others_keep_serving(svc: Service) -> None:
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0,
                           timeout=300)
    with pytest.raises(openai.APIStatusError) as got:
        client.chat.completions.create(model="broken", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi."}])
    assert got.value.status_code == 503 and "could not be loaded" in str(got.value)
    with svc.client() as c:
        listed = c.get("/v1/models/broken").json()["status"]
    assert listed["value"] == "failed" and "broken.gguf" in listed["reason"]
    assert svc.state_dir not in listed["reason"]  # (the server's folders are its own)
    assert f"broken: {listed['reason']}" in str(got.value)  # the model and why, named
    assert chat(svc, "smollm2")
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}) as c:
        again = c.post("/v1/chat/completions", json={
            "model": "broken", "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": 4})
    assert again.status_code == 503 and again.headers.get("retry-after")
