"""``/v1/responses`` in process over a scripted broker (tests/unit/test_gateway_http.py):
what a background answer says, that a deleted response answers 404 without asking the
device, and that the retention sweep forgets exactly the rows whose request the device
no longer holds."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from typing import Any

from aotx import wire
from aotx.config import Settings
from aotx.gateway.app import create_app
from aotx.gateway.response_store import SWEEP_ROWS, ResponseStore
from aotx.gateway.responses import parse_response_id
from aotx.gateway.routes_responses import sweep
from aotx.gateway.service import Gateway
from aotx.paths import RuntimePaths

from ..helpers import short_tmpdir
from .test_gateway_http import EPOCH, IDENT, ScriptedBroker, asgi_client, state


def test_background_delete_and_the_retention_sweep() -> None:
    folder = short_tmpdir()
    broker = ScriptedBroker()
    app: Any = create_app(RuntimePaths(folder), Settings(), broker=broker)  # type: ignore[arg-type]
    held = {"yes": True}

    def read(h: wire.Header, _: bytes) -> tuple[wire.Header, bytes]:
        if not held["yes"]:
            return h.refuse(404, wire.Reason.NO_REQUEST)._replace(epoch=EPOCH), b""
        return state(h, phase=wire.Phase.RUNNING, total=5), b"Hello"[h.cursor:]

    broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
    broker.script[wire.Op.READ] = read
    broker.script[wire.Op.CANCEL] = lambda h, p: (state(h, 202, cancel_requested=1), b"")

    async def go() -> None:
        async with asgi_client(app, RuntimePaths(folder)) as c:
            st: ResponseStore = app.app.state.responses
            g: Gateway = app.app.state.gateway
            r = await c.post("/v1/responses", json={"model": "smollm2", "input": "hi",
                                                    "background": True, "metadata": {"k": "v"}})
            body = r.json()
            assert r.status_code == 200 and body["status"] == "queued" and body["output"] == []
            assert parse_response_id(body["id"]) == (EPOCH, IDENT)
            assert r.headers["x-request-id"] == f"req-{EPOCH:016x}-{IDENT.hex()}"
            got = (await c.get(f"/v1/responses/{body['id']}")).json()
            assert got["status"] == "in_progress" and got["metadata"] == {"k": "v"}
            assert got["output"][0]["content"][0]["text"] == "Hello"
            items = (await c.get(f"/v1/responses/{body['id']}/input_items")).json()
            assert [i["content"][0]["text"] for i in items["data"]] == ["hi"]

            # The sweep asks the device only about rows older than its retention, and
            # forgets a row once the device has reclaimed its request.
            assert await sweep(g, st) == 0 and st.count() == 1
            st.db.execute("UPDATE responses SET created_at = created_at - 5000, "
                          "checked_at = checked_at - 5000")
            reads = len([h for h in broker.sent if h.op == wire.Op.READ])
            assert await sweep(g, st) == 0 and st.count() == 1  # still held
            assert len([h for h in broker.sent if h.op == wire.Op.READ]) == reads + 1
            assert await sweep(g, st) == 0  # checked a moment ago: not again yet
            st.db.execute("UPDATE responses SET checked_at = checked_at - 5000")
            held["yes"] = False
            assert await sweep(g, st) == 1 and st.count() == 0

            # Delete: cancelled on the device, then 404 without asking it again.
            held["yes"] = True
            r = await c.post("/v1/responses", json={"model": "smollm2", "input": "again",
                                                    "background": True})
            rid = r.json()["id"]
            assert (await c.delete(f"/v1/responses/{rid}")).json()["deleted"] is True
            # (the gateway's poll loop sends INFO now and then: not the route's calls)
            asked = [h for h in broker.sent if h.op != wire.Op.INFO]
            assert asked[-1].op == wire.Op.CANCEL
            for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
                assert (await c.get(path)).status_code == 404
            assert [h for h in broker.sent if h.op != wire.Op.INFO] == asked

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_one_sweep_checks_every_row_due() -> None:
    """Above a response a second, one batch a minute would fall behind the retention:
    a sweep checks every row due, a batch after another, each once."""
    folder = short_tmpdir()
    broker = ScriptedBroker()
    app: Any = create_app(RuntimePaths(folder), Settings(), broker=broker)  # type: ignore[arg-type]
    broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
    broker.script[wire.Op.READ] = lambda h, p: (
        h.refuse(404, wire.Reason.NO_REQUEST)._replace(epoch=EPOCH), b"")

    async def go() -> None:
        async with asgi_client(app, RuntimePaths(folder)) as c:
            st: ResponseStore = app.app.state.responses
            g: Gateway = app.app.state.gateway
            st.last_sweep = time.monotonic()  # no sweep of its own beside this request
            r = await c.post("/v1/responses", json={"model": "smollm2", "input": "hi",
                                                    "background": True})
            assert r.status_code == 200
            (pid,) = st.db.execute("SELECT principal FROM responses").fetchone()
            old = time.time() - 5000
            for i in range(2 * SWEEP_ROWS + 20):
                st.seen(pid, EPOCH, bytes(14) + i.to_bytes(2, "big"), old)
            st.db.execute("UPDATE responses SET created_at = ?, checked_at = ?", (old, old))
            reads = len([h for h in broker.sent if h.op == wire.Op.READ])
            assert await sweep(g, st) == 2 * SWEEP_ROWS + 21 and st.count() == 0
            assert len([h for h in broker.sent if h.op == wire.Op.READ]) == \
                reads + 2 * SWEEP_ROWS + 21

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_sdks_decoder_reads_every_event_keep_alives_included() -> None:
    """A stream that waits sends keep-alive comments; the openai SDK's SSE decoder must
    read the stream as events only (with SSE ids it would dispatch an empty event after
    each comment and fail on its JSON: why events carry no id)."""
    from openai._streaming import SSEDecoder

    folder = short_tmpdir()
    broker = ScriptedBroker()
    app: Any = create_app(RuntimePaths(folder), Settings(), broker=broker)  # type: ignore[arg-type]
    states = iter([(wire.Phase.RUNNING, 0, wire.Finish.NONE, b""),
                   (wire.Phase.COMPLETED, 8, wire.Finish.STOP, b"Hi there")])

    def wait(h: wire.Header, _: bytes) -> tuple[wire.Header, bytes]:
        phase, total, finish, data = next(states)
        return state(h, phase=phase, total=total, finish=int(finish)), data[h.cursor:]

    broker.script[wire.Op.READ] = lambda h, p: (state(h, phase=wire.Phase.QUEUED), b"")
    broker.script[wire.Op.WAIT] = wait

    async def go() -> None:
        async with asgi_client(app, RuntimePaths(folder)) as c:
            r = await c.get(f"/v1/responses/resp_{EPOCH:016x}{IDENT.hex()}?stream=true")
            assert b": keep-alive" in r.content
            events = [json.loads(sse.data) for sse in SSEDecoder().iter_bytes(iter([r.content]))]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[-1]["type"] == "response.completed"
            assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi there"

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
