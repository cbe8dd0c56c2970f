"""The resident policy turns on when a model qualified for automatic memory is loaded on
first use: here the models loaded at start (Gemma 3) do not qualify, and the models
folder's copy of the embedded SmolLM2 does."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from aotx.device.models import default_model_path

from ..helpers import GEMMA_TEMPLATE, Service, eventually, gemma_path, running_service
from .test_e2e_on_demand import place

MODELS = f'''
[default]
enabled = false

[[model]]
alias = "gemma3"
path = "{gemma_path()}"
chat_template = "{GEMMA_TEMPLATE}"
slots = 2
context = 2048
'''


def folder(state: str) -> None:
    os.makedirs(os.path.join(state, "models"))
    place(default_model_path(), os.path.join(state, "models", "copy.gguf"))


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    with running_service(folder, models=MODELS) as s:
        yield s


def test_the_policy_starts_when_a_qualified_model_is_loaded_on_first_use(svc: Service) -> None:
    with svc.client() as c:
        assert c.get("/aotx/v1/policy").json()["state"] == "off"
        assert c.get("/aotx/v1/capabilities").json()["features"]["automatic_memory"] is False
        r = c.post("/v1/chat/completions", timeout=300, json={
            "model": "copy", "messages": [{"role": "user", "content": "My name is Ada."}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        caps = eventually(lambda: (lambda j: j if j["features"]["automatic_memory"] else None)(
            c.get("/aotx/v1/capabilities").json()), 30)
        rows = {m["alias"]: m for m in caps["models"]}
        assert rows["copy"]["automatic_memory"] and not rows["gemma3"]["automatic_memory"]
        assert c.get("/aotx/v1/policy").json()["state"] != "off"
