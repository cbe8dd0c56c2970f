"""The console's models (headless Chromium): every model with its state, an admin's
Load and Unload buttons, and the picker that sends a chat to a model loaded on first
use."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from aotx.client import Client
from aotx.device.models import default_model_path

from ..helpers import Service, running_service
from .test_console import CHROMIUM, browser
from .test_e2e_grants import mint
from .test_e2e_on_demand import place

__all__ = ["browser"]  # (the fixture, shared with test_console)
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="Debian's chromium is not installed (scripts/test installs it)")


def folder(state: str) -> None:
    os.makedirs(os.path.join(state, "models"))
    place(default_model_path(), os.path.join(state, "models", "copy.gguf"))


@pytest.fixture(scope="module")
def msvc() -> Iterator[Service]:
    with running_service(folder) as svc:
        yield svc


def sign_in(browser, svc: Service, token: str):  # type: ignore[no-untyped-def]
    page = browser.new_page()
    page.goto(svc.url + "/console/")
    page.fill("#token", token)
    page.click("#signin-button")
    page.wait_for_selector("#app:not([hidden])")
    return page


def row_state(page, alias: str, state: str, timeout: int = 60000) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector(f'#models-table tr[data-alias="{alias}"][data-state="{state}"]',
                           timeout=timeout)


def test_an_admin_loads_and_unloads_from_the_models_table(msvc: Service, browser) -> None:
    page = sign_in(browser, msvc, msvc.token)
    row_state(page, "copy", "unloaded")
    row_state(page, "smollm2", "loaded")
    assert page.locator('tr[data-alias="smollm2"] button').count() == 0  # loaded at start
    assert "memory budget" in page.inner_text("#models-budget")
    page.click('tr[data-alias="copy"] button[data-action="load"]')
    row_state(page, "copy", "loaded")
    page.click('tr[data-alias="copy"] button[data-action="unload"]')
    row_state(page, "copy", "unloaded")
    page.close()


def test_the_picker_chats_with_a_model_loaded_on_first_use(msvc: Service, browser) -> None:
    user = mint(msvc, "console-user")
    page = sign_in(browser, msvc, user)
    row_state(page, "copy", "unloaded")
    assert page.locator("#models-table button").count() == 0  # not an admin
    assert "copy (unloaded)" in page.inner_text("#model-pick")
    page.select_option("#model-pick", "copy")
    assert "copy" in page.inner_text("#model")
    page.fill("#prompt", "Name a colour.")
    page.click("#send")
    page.wait_for_function("document.getElementById('stream-status').textContent"
                           ".includes('completed')", timeout=120000)
    rid = page.get_attribute(".turn.bot >> nth=0", "data-request-id")
    with Client(msvc.url, user) as c:  # the page showed the device's bytes, from copy
        assert c.read_all(rid).decode("utf-8", errors="replace").strip() == \
            page.inner_text(".turn.bot >> nth=0 >> .text").strip()
    row_state(page, "copy", "loaded")
    page.close()
