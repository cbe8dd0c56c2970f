"""A model put in the models folder while the service runs is served without a restart
(device/watch.py); one whose file goes away shows failed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from aotx.device.models import default_model_path

from ..helpers import Service, eventually, running_service
from .test_e2e_grants import client, mint


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    with running_service(lambda state: os.makedirs(os.path.join(state, "models"))) as s:
        yield s


def listed(c: httpx.Client, alias: str) -> dict[str, Any] | None:
    r = c.get(f"/v1/models/{alias}")
    return dict(r.json()["status"]) if r.status_code == 200 else None


def test_a_model_put_in_the_folder_is_served_and_one_removed_fails(svc: Service) -> None:
    carol = mint(svc, "carol-watch", "--models", "late")  # names a model not there yet
    with client(svc, carol) as c:
        assert c.get("/v1/models/late").status_code == 404
        path = os.path.join(svc.state_dir, "models", "late.gguf")
        shutil.copyfile(default_model_path(), path + ".tmp")  # (a copy lands whole)
        os.replace(path + ".tmp", path)
        status = eventually(lambda: listed(c, "late"), 60)
        assert status["value"] == "unloaded" and status["on_demand"]
        r = c.post("/v1/chat/completions", timeout=300, json={
            "model": "late", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    with svc.client() as admin:
        assert admin.post("/aotx/v1/models/late/unload").status_code in (200, 202)
        eventually(lambda: (listed(admin, "late") or {}).get("value") == "unloaded", 60)
        os.remove(path)
        gone = eventually(lambda: (lambda s: s if s and s["value"] == "failed" else None)(
            listed(admin, "late")), 60)
        assert "gone" in gone["reason"]
