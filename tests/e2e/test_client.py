"""aotx.client against the real service, and the submit/follow CLI (issue 10, first part)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from aotx.client import AsyncClient, Client, Conflict, Emission, Gone, NotFound, RequestState

from ..helpers import Service, png

RUSSIAN = [{"role": "user", "content": "Write a sentence in Russian."}]
LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def test_submit_text_windows_and_errors(service: Service) -> None:
    with Client(service.url, service.token) as c:
        assert c.capabilities()["schema"] == "aotx.capabilities.v1"
        adm = c.submit(RUSSIAN, max_tokens=40, temperature=0)
        text = "".join(c.text(adm.id))
        state = c.wait(adm.id)
        assert state.state == "completed" and state.usage["completion_tokens"] > 0
        full = c.read_all(adm.id)
        assert text == full.decode("utf-8") and any(ord(ch) > 127 for ch in text)
        # resuming inside a multi-byte character still gives the exact suffix as bytes
        k = next(i for i, b in enumerate(full) if b >= 0xC0) + 1
        got = b"".join(e.data for e in c.events(adm.id, k) if isinstance(e, Emission))
        assert got == full[k:]
        # as text: from the first whole character after the cursor
        whole = next(i for i in range(k, len(full)) if not 0x80 <= full[i] < 0xC0)
        assert "".join(c.text(adm.id, k)) == full[whole:].decode()
        with pytest.raises(Conflict) as err:
            c.get(adm.id, len(full) + 1)
        assert err.value.status == 409 and err.value.error["type"] == "conflict_error"
        epoch = adm.id[4:20]
        with pytest.raises(NotFound):
            c.get(f"req-{epoch}-{'0' * 32}")
        with pytest.raises(NotFound):
            list(c.events(f"req-{epoch}-{'0' * 32}"))
        cancelled = c.submit(LONG, max_tokens=1000)
        c.cancel(cancelled.id)
        assert c.wait(cancelled.id).state in ("cancelled", "completed")
        src = c.upload_media(png(42), "image/png")
        assert src["id"] in [m["id"] for m in c.list_media(limit=1)]
        c.remove_media(src["id"])
        with pytest.raises(NotFound):
            c.get_media(src["id"])
        assert int(c.telemetry()["sample"]["device_tick"]) > 0


def test_async_client(service: Service) -> None:
    async def main() -> tuple[str, bytes, RequestState]:
        async with AsyncClient(service.url, service.token) as c:
            adm = await c.submit(RUSSIAN, max_tokens=24, temperature=0)
            text = "".join([t async for t in c.text(adm.id)])
            full = await c.read_all(adm.id)
            k = next(i for i, b in enumerate(full) if b >= 0xC0) + 1  # inside a character
            tail = "".join([t async for t in c.text(adm.id, k)])
            assert full.decode().endswith(tail) and len(tail.encode()) > len(full) - k - 3
            # the media and policy methods, as the synchronous client's
            src = await c.upload_media(png(43), "image/png")
            assert src["id"] in [m["id"] async for m in c.list_media(limit=1)]
            assert (await c.get_media(src["id"]))["id"] == src["id"]
            await c.remove_media(src["id"])
            with pytest.raises(NotFound):
                await c.get_media(src["id"])
            policy = await c.policy()
            with pytest.raises(Conflict):  # a stale revision
                await c.control_policy("pause", int(policy["control_revision"]) + 1)
            return text, full, await c.wait(adm.id)

    text, full, state = asyncio.run(main())
    assert text == full.decode("utf-8") and state.terminal


def test_follow_survives_a_gateway_restart(fresh_service: Service) -> None:
    fresh_service.start()
    with Client(fresh_service.url, fresh_service.token) as c:
        adm = c.submit(LONG, max_tokens=300, temperature=0)
        got = b""
        killed = False
        statuses = []
        for item in c.events(adm.id):
            if isinstance(item, Emission):
                assert item.offset == len(got)  # exact resume: no gap, no repeat
                got += item.data
                if len(got) > 30 and not killed:
                    os.kill(fresh_service.children()["gateway"], signal.SIGKILL)
                    killed = True
            else:
                statuses.append(item.state)
        assert killed and statuses[-1] == "completed"
        assert got == c.read_all(adm.id)
        assert "event=serve.restart component=gateway" in fresh_service.read_log()


def test_gone_after_a_device_restart(fresh_service: Service) -> None:
    fresh_service.start()
    with Client(fresh_service.url, fresh_service.token) as c:
        adm = c.submit(RUSSIAN, max_tokens=4)
        c.wait(adm.id)
    fresh_service.stop()
    fresh_service.start()
    with Client(fresh_service.url, fresh_service.token) as c, pytest.raises(Gone) as err:
        c.get(adm.id)
    assert err.value.status == 410


def test_cli_submit_follow_and_reattach(service: Service) -> None:
    env = {**os.environ}
    base = [sys.executable, "-m", "aotx"]
    common = ["--state-dir", service.state_dir]
    r = subprocess.run(base + ["submit", "Name three colors.", "--max-tokens", "16", "--follow",
                               *common], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    rid, text = r.stdout.split("\n", 1)
    assert rid.startswith("req-") and "[completed" in r.stderr
    again = subprocess.run(base + ["follow", rid, *common], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and again.stdout == text
    with Client(service.url, service.token) as c:
        assert c.read_all(rid).decode() == again.stdout
        other = c.submit(RUSSIAN, max_tokens=24, temperature=0).id
        c.wait(other)
        full = c.read_all(other)
    # from a byte offset inside a character: the text from the next whole one
    k = next(i for i, b in enumerate(full) if b >= 0xC0) + 1
    tail = subprocess.run(base + ["follow", other, "--cursor", str(k), *common],
                          capture_output=True, text=True, timeout=60)
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout == full[k:].lstrip(bytes(range(0x80, 0xC0))).decode()
    bad = subprocess.run(base + ["follow", other, "--cursor", "-5", *common],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cursor: must be a byte offset" in bad.stderr
    gone = subprocess.run(base + ["submit", "hi", "--url", "http://127.0.0.1:1", "--token", "x"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "is not answering" in gone.stderr
    assert "Traceback" not in gone.stderr


def _default_sigint() -> None:
    """Ctrl-C's default in the child: a test run started in the background (a shell
    without job control) ignores SIGINT, and a Python started so ignores it too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_ctrl_c_cancels_on_the_device(service: Service) -> None:
    # greedy, on a prompt whose answer runs for hundreds of tokens: still going at 1 s
    proc = subprocess.Popen([sys.executable, "-m", "aotx", "submit", LONG[0]["content"],
                             "--max-tokens", "2000", "--temperature", "0", "--follow",
                             "--state-dir",
                             service.state_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint)
    assert proc.stdout is not None
    rid = proc.stdout.readline().strip()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.read()))  # type: ignore[union-attr]
    reader.start()
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    reader.join(10)
    with Client(service.url, service.token) as c:
        final = c.wait(rid)
    assert final.state == "cancelled" and final.cancel_requested


def test_cli_chat_through_a_pseudo_terminal(service: Service) -> None:
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # child: the chat on the terminal
        os.execv(sys.executable, [sys.executable, "-m", "aotx", "chat", "--state-dir",
                                  service.state_dir, "--max-tokens", "12"])
    out = b""

    def read_until(marker: bytes, count: int = 1, timeout: float = 90) -> None:
        nonlocal out
        deadline = time.monotonic() + timeout
        while out.count(marker) < count:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                out += os.read(fd, 4096)

    try:
        read_until(b"you> ", 1)
        os.write(fd, b"Say hello.\n")
        read_until(b"you> ", 2)  # the answer streamed, then the prompt again
        os.write(fd, b"And again?\n")
        read_until(b"you> ", 3)
        os.write(fd, b"\x04")  # Ctrl-D ends the session
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    text = out.decode(errors="replace")
    assert text.count("bot> ") == 2 and "aotx chat on http://127.0.0.1" in text
