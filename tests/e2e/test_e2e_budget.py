"""Models loaded on first use under a memory budget that holds one of them (beside the
embedded model): they load and unload in turn (device/fleet.py's rule)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from aotx.device.models import default_model_path
from aotx.engine.load import describe
from aotx.engine.spec import ModelSpec

from ..helpers import (
    GEMMA_TEMPLATE,
    SMALL_MODELS,
    Service,
    eventually,
    gemma_path,
    running_service,
)
from .test_e2e_grants import mint
from .test_e2e_on_demand import place

COPY = ModelSpec(alias="copy", path=default_model_path(), role=0, slots=2, context=2048)
GEMMA = ModelSpec(alias="gemma3", path=gemma_path(), role=0, slots=2, context=2048)


def models(copy: str = "300", gemma: str = "300") -> str:
    keep = {"copy": copy, "gemma3": gemma}
    return SMALL_MODELS + "".join(
        f'[[model]]\nalias = "{s.alias}"\npath = "models/{s.alias}.gguf"\nslots = 2\n'
        f'context = 2048\non_demand = true\nkeep_alive = {keep[s.alias]}\n'
        + (f'chat_template = "{GEMMA_TEMPLATE}"\n' if s is GEMMA else "")
        for s in (COPY, GEMMA))


def budget() -> int:
    """Room for the embedded model and the larger of the two, not for both."""
    fixed = describe(ModelSpec(alias="smollm2", path=default_model_path(), role=1, slots=4,
                               context=2048))
    one = max(describe(COPY).memory_bytes, describe(GEMMA).memory_bytes)
    assert min(describe(COPY).memory_bytes, describe(GEMMA).memory_bytes) > 16 << 20
    return fixed.weights_bytes + fixed.kv_bytes + one + (16 << 20)


def folder(state: str) -> None:
    os.makedirs(os.path.join(state, "models"))
    place(default_model_path(), os.path.join(state, "models", "copy.gguf"))
    place(gemma_path(), os.path.join(state, "models", "gemma3.gguf"))


def budgeted(models: str) -> contextlib.AbstractContextManager[Service]:
    return running_service(folder, models=models, extra_args=[
        "--memory-budget", str(budget()), "--load-wait-seconds", "3"])


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    with budgeted(models()) as s:
        yield s


def metrics(svc: Service) -> str:
    with svc.client() as c:
        return c.get("/metrics").text


def value(text: str, name: str, labels: str) -> float:
    found = re.search(rf"^{name}{{{labels}}} ([0-9.e+]+)$", text, re.M)
    return float(found[1]) if found else 0.0


def chat(c: httpx.Client, model: str) -> httpx.Response:
    return c.post("/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6, "temperature": 0})


def test_alternating_requests_load_and_evict_in_turn(svc: Service) -> None:
    with svc.client() as c:
        first = [chat(c, m).json()["choices"][0]["message"]["content"]
                 for m in ("smollm2", "copy", "gemma3", "copy", "gemma3")]
    assert first[1] == first[3] == first[0]  # the same file as the embedded model, greedy
    assert first[2] == first[4]
    text = metrics(svc)
    assert value(text, "aotx_model_loads_total", 'model="copy"') == 2
    assert value(text, "aotx_model_loads_total", 'model="gemma3"') == 2
    assert value(text, "aotx_model_evictions_total", 'model="copy"') == 2
    assert value(text, "aotx_model_evictions_total", 'model="gemma3"') == 1
    assert value(text, "aotx_model_state", 'model="gemma3",state="loaded"') == 1


def test_another_principals_model_in_use_is_not_evicted(svc: Service) -> None:
    """Alice used gemma3 a moment ago (its keep-alive is five minutes): Bob's request for
    the copy cannot unload it, waits the load wait (3 s here) and gets 503 with
    Retry-After, and gemma3 stays loaded for Alice; Bob may use gemma3 itself."""
    a, b = mint(svc, "alice"), mint(svc, "bob")
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {a}"}) as ca, \
            httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {b}"}) as cb:
        assert chat(ca, "gemma3").status_code == 200
        t0 = time.monotonic()
        refused = chat(cb, "copy")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "model_memory_busy"
        assert refused.headers["retry-after"] == "5" and time.monotonic() - t0 >= 3
        assert value(metrics(svc), "aotx_model_state", 'model="gemma3",state="loaded"') == 1
        assert chat(cb, "gemma3").status_code == 200
        assert chat(ca, "gemma3").status_code == 200


def test_keep_alive_zero_unloads_when_idle_and_a_pinned_model_stays() -> None:
    with budgeted(models(copy="0", gemma="-1")) as s:
        with s.client() as c:
            assert chat(c, "copy").status_code == 200
        eventually(lambda: value(metrics(s), "aotx_model_state",
                                 'model="copy",state="unloaded"') == 1.0, 30)
        with s.client() as c:
            assert chat(c, "gemma3").status_code == 200  # pinned (keep_alive = -1)
            refused = chat(c, "copy")  # no room beside it, and it is never unloaded
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        text = metrics(s)
        assert value(text, "aotx_model_state", 'model="gemma3",state="loaded"') == 1
        assert value(text, "aotx_model_evictions_total", 'model="gemma3"') == 0
        assert value(text, "aotx_model_loads_total", 'model="copy"') == 1


def test_a_model_with_a_running_stream_is_not_evicted() -> None:
    """The copy streams a long answer; the same principal's request for Gemma 3, which
    fits only without the copy, waits the load wait (3 s) and gets 503 with Retry-After
    (the copy is busy, whoever asks), and the stream ends whole."""
    with budgeted(models()) as s, s.client() as c:
        with c.stream("POST", "/v1/chat/completions", timeout=300, json={
                "model": "copy", "stream": True, "max_tokens": 1200, "temperature": 0,
                "logit_bias": {"2": -100},  # (SmolLM2's <|im_end|>: it runs to the end)
                "messages": [{"role": "user", "content": "Tell me a long story."}]}) as r:
            lines = r.iter_lines()
            assert any('"content"' in line for line in lines)  # it is running
            refused = chat(c, "gemma3")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "model_memory_busy"
            assert refused.headers["retry-after"] == "5"
            rest = list(lines)
        assert any('"finish_reason":"length"' in line.replace(" ", "") for line in rest)
        text = metrics(s)
        assert value(text, "aotx_model_evictions_total", 'model="copy"') == 0
        assert value(text, "aotx_model_state", 'model="copy",state="loaded"') == 1
