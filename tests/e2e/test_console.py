"""The web console in headless Chromium (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from aotx.client import Client

from ..helpers import Service, running_service

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="Debian's chromium is not installed (scripts/test installs it)")


@pytest.fixture(scope="module")
def csvc() -> Iterator[Service]:
    with running_service() as svc:
        yield svc


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            yield b
        finally:
            b.close()


def assert_turn_shows_device_bytes(svc: Service, page, n: int, timeout: int) -> None:
    """Once the stream completes, the page's n-th answer equals the bytes the device holds."""
    page.wait_for_function("document.getElementById('stream-status').textContent"
                           ".includes('completed')", timeout=timeout)
    rid = page.get_attribute(f".turn.bot >> nth={n}", "data-request-id")
    shown = page.inner_text(f".turn.bot >> nth={n} >> .text")
    with Client(svc.url, svc.token) as c:
        # the page decodes with TextDecoder, which replaces invalid UTF-8 (a sampled
        # byte-level token may be one); decode the device's bytes the same way
        assert c.read_all(rid).decode("utf-8", errors="replace").strip() == shown.strip()


def signed_in(browser, svc: Service, token: str, prompt: str):  # type: ignore[no-untyped-def]
    """A new page signed in with ``token``, ``prompt`` sent."""
    page = browser.new_page()
    page.goto(svc.url + "/console/")
    page.fill("#token", token)
    page.click("#signin-button")
    page.wait_for_selector("#app:not([hidden])")
    page.fill("#prompt", prompt)
    page.click("#send")
    return page


def test_console_sign_in_chat_live_and_policy(csvc: Service, browser) -> None:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(csvc.url + "/console/")
    # a wrong token gets a clear 401 message, and the app stays hidden
    page.fill("#token", "not-a-token")
    page.click("#signin-button")
    page.wait_for_selector("#message:not([hidden])")
    assert "401" in page.inner_text("#message")
    assert page.is_hidden("#app")
    page.fill("#token", csvc.token)
    page.click("#signin-button")
    page.wait_for_selector("#app:not([hidden])")
    assert "smollm2" in page.inner_text("#model")
    # no token anywhere but the page's memory
    assert ctx.cookies() == []
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0

    # chat: the text streams in, and equals the bytes the device holds
    page.fill("#prompt", "Say hello in Russian.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.turn.bot .text').textContent.length > 0")
    assert_turn_shows_device_bytes(csvc, page, 0, timeout=120_000)

    # a network drop in the middle of a stream: the page resumes at its byte cursor
    page.fill("#prompt", "Write a long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function(
        "document.querySelectorAll('.turn.bot .text')[1].textContent.length > 20")
    ctx.set_offline(True)
    page.wait_for_timeout(1500)
    ctx.set_offline(False)
    assert_turn_shows_device_bytes(csvc, page, 1, timeout=180_000)

    # live figures come from telemetry and /metrics
    page.wait_for_function("document.getElementById('live-figures').textContent.includes('tick')")

    # the policy: pause, then resume
    page.click("#policy button[data-action=pause]")
    page.wait_for_function("document.getElementById('policy-status').dataset.state === 'paused'")
    page.click("#policy button[data-action=resume]")
    page.wait_for_function(
        "['quiet', 'recording', 'active'].includes("
        "document.getElementById('policy-status').dataset.state)")
    # (refreshed every 3 s; the offline spell above may have left a network error there)
    page.wait_for_function(
        "document.getElementById('memory-saved').textContent.includes('nothing saved')")
    page.screenshot(path=os.path.join(csvc.state_dir, "console.png"))
    ctx.close()


def test_console_shows_403_for_a_limited_token(csvc: Service, browser) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "aotx", "token", "create", "--state-dir",
                        csvc.state_dir, "--principal", "viewer", "--actions", "read"],
                       capture_output=True, text=True, check=True)
    token = r.stdout.strip().splitlines()[-1]
    page = signed_in(browser, csvc, token, "hello")
    page.wait_for_selector("#message:not([hidden])")
    assert "403" in page.inner_text("#message")
    page.wait_for_function("document.getElementById('policy-status').textContent.includes('403')")
    page.close()


def test_an_error_in_the_stream_is_shown_with_its_status(csvc: Service, browser) -> None:
    """An ``error`` event names its status by its type (its code is a word): the token's
    grant goes while a stream runs, and the page says 403 at once, without the retries
    it gives a 503 (which would end in the reconnect's 401)."""
    import subprocess
    import sys

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "aotx", "token", *args, "--state-dir",
                               csvc.state_dir], capture_output=True, text=True,
                              check=True).stdout
    made = cli("create", "--principal", "streamer").strip().splitlines()
    token, tid = made[-1], made[0].split()[1]
    page = signed_in(browser, csvc, token, "Write a long story about a lighthouse keeper.")
    page.wait_for_function("document.querySelector('.turn.bot .text').textContent.length > 20")
    cli("revoke", tid)
    page.wait_for_selector("#message:not([hidden])", timeout=30_000)
    assert "403" in page.inner_text("#message"), page.inner_text("#message")
    page.close()
