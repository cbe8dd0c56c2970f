"""The gateway's HTTP edge in process: the real application (routers, guard, handlers)
over httpx's ASGI transport, with a scripted broker in place of service.sock; and, for
what only raw bytes reach (malformed requests, request targets, timeouts), the same app
served by uvicorn on 127.0.0.1 as ``aotx serve`` configures it (``served``).

These are the cases that once only the end-to-end tests reached: authentication, the
Host guard, body limits, how each device reason is worded, event-stream rules, the
policy's conflicts, and what a 503 says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from aotx import ids, wire
from aotx.config import Settings
from aotx.gateway import (
    broker_client,
    routes_media,
    routes_native,
    routes_openai,
    routes_ops,
    routes_policy,
)
from aotx.gateway.app import create_app, server_config
from aotx.gateway.broker_client import BrokerUnavailable, DeviceSilent
from aotx.gateway.errors import INTERNAL, error_body
from aotx.paths import RuntimePaths

from ..helpers import eventually, free_port, short_tmpdir
from .brokers import AnsweringBroker

EPOCH = 3
INFO = wire.Info(epoch=EPOCH, models=(wire.ModelInfo(1, "smollm2", bytes(32), wire.MOD_TEXT, 0,
                                                     2048),),
                 window_bytes=32768, context_tokens=2048, output_tokens=2048,
                 active_requests=64, slots=4, mailboxes=8)
#: The device's MODELS read (device/residency.py) for INFO's one model.
RESIDENCY = {"budget_bytes": 1 << 30, "used_bytes": 200 << 20, "unassigned": [], "models": [
    {"alias": "smollm2", "role": 1, "state": "loaded", "reason": None, "on_demand": False,
     "file_bytes": 100 << 20, "memory_bytes": 200 << 20, "vram_bytes": 0, "sha256": "00" * 32,
     "keep_alive": -1, "expires_in": None, "unload_asked": False, "loads": 1,
     "evictions": 0}]}
IDENT = bytes(range(16))
RID = ids.format_request_id(EPOCH, IDENT)
Answer = Callable[[wire.Header, bytes], tuple[wire.Header, bytes]]


class ScriptedBroker(AnsweringBroker):
    """Answers INFO and the grant operations as a device would; every other operation
    from ``script`` (op -> answer), so a test says exactly what the device replies."""

    def __init__(self) -> None:
        self.script: dict[int, Answer] = {}
        self.grants: dict[int, wire.Grant] = {}
        self.sent: list[wire.Header] = []
        self.down = False
        self.packets_sent = 0
        self.waits_sent = 0
        self.timeouts: dict[int, float] = {}  # op -> the deadline of its latest call

    async def answer(self, h: wire.Header, payload: bytes, timeout: float
                     ) -> tuple[wire.Header, bytes]:
        if self.down:
            raise BrokerUnavailable("cannot reach the broker at /secret/run/service.sock")
        wire.check_request(h)  # the gateway sends nothing the device would refuse
        self.sent.append(h)
        self.timeouts[h.op] = timeout
        if h.op == wire.Op.INFO:
            return h.reply(200, epoch=EPOCH), wire.encode_info(INFO)
        if h.op == wire.Op.GRANT_READ:
            rows = sorted(self.grants.values(), key=lambda g: g.principal)
            return h.reply(200, epoch=EPOCH, total=len(rows)), wire.encode_grants(rows)
        if h.op == wire.Op.GRANT_INSTALL:
            for g in wire.decode_grants(payload, h.row_count):
                self.grants[g.principal] = g._replace(revision=1)
            return h.reply(200, epoch=EPOCH, total=h.row_count), b""
        if h.op == wire.Op.MODELS and h.op not in self.script:
            return h.reply(200, epoch=EPOCH), orjson.dumps(RESIDENCY)
        return self.script[h.op](h, payload)

    async def close(self) -> None:
        pass


@pytest.fixture
def gw() -> Any:
    """``gw(test)`` runs ``test(client, broker)`` against the app; ``gw(test, False)``
    lets the client see the 500 an unexpected exception answers instead of raising it."""
    state = short_tmpdir()
    broker = ScriptedBroker()
    app = create_app(RuntimePaths(state), Settings(body_timeout=2), broker=broker)  # type: ignore[arg-type]

    async def run(test: Callable[[httpx.AsyncClient, ScriptedBroker], Awaitable[None]],
                  raise_app_exceptions: bool) -> None:
        async with asgi_client(app, RuntimePaths(state), raise_app_exceptions) as c:
            await test(c, broker)

    try:
        yield lambda test, raises=True: asyncio.run(run(test, raises))
    finally:
        shutil.rmtree(state, ignore_errors=True)


@contextlib.asynccontextmanager
async def asgi_client(app: Any, paths: RuntimePaths,
                      raise_app_exceptions: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``app`` in process (its lifespan running), with the admin token."""
    fastapi_app = app.app
    async with fastapi_app.router.lifespan_context(fastapi_app):
        token = open(paths.admin_token).read().strip()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     headers={"Authorization": f"Bearer {token}"}) as c:
            yield c


@dataclass
class Served:
    port: int
    broker: ScriptedBroker
    token: str

    def raw(self, data: bytes, wait: float = 5) -> bytes:
        """Send ``data`` on a new connection; everything the server answers until it
        closes (or ``wait`` seconds pass)."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.settimeout(wait)
            s.sendall(data)
            out = b""
            with contextlib.suppress(TimeoutError):
                while chunk := s.recv(65536):
                    out += chunk
        return out


@pytest.fixture
def served() -> Iterator[Served]:
    """The application served by uvicorn as ``aotx serve`` configures it (the guarded
    protocol class), on 127.0.0.1, for what only real HTTP bytes reach: malformed
    requests, request targets, the header timeout."""
    state = short_tmpdir()
    broker = ScriptedBroker()
    settings = Settings(header_timeout=1, body_timeout=1)
    app = create_app(RuntimePaths(state), settings, broker=broker)  # type: ignore[arg-type]
    server = uvicorn.Server(server_config(app, "127.0.0.1", free_port(), settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        eventually(lambda: server.started, 10)
        yield Served(server.config.port, broker,
                     open(RuntimePaths(state).admin_token).read().strip())
    finally:
        server.should_exit = True
        thread.join(10)
        shutil.rmtree(state, ignore_errors=True)


def raw_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    """The status and error object of a raw HTTP answer (which must be JSON)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "code", "param"}
    return int(head.split(b" ", 2)[1]), err


def state(h: wire.Header, status: int = 200, phase: wire.Phase = wire.Phase.RUNNING,
          **fields: Any) -> wire.Header:
    return h.reply(status, epoch=EPOCH, identity=IDENT, phase=int(phase), role=1, **fields)


def error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    return dict(err)


def test_the_body_is_checked_then_the_token_then_the_fields(gw: Any) -> None:
    """docs/api.md's order of checks: a JSON route's body must be a JSON object (400,
    whatever its Content-Type, with or without a token), then the token (401), then
    the fields (400)."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer nope"},
                        {"Authorization": "Basic abc"}):
            for body in (json.dumps(BODY).encode(), b'{"model": 5}'):
                r = await c.post("/aotx/v1/requests", content=body, headers=headers)
                assert r.status_code == 401 and error(r)["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
            r = await c.post("/aotx/v1/requests", content=b"{not json", headers=headers)
            assert r.status_code == 400 and error(r)["message"] == "the body is not valid JSON"
        r = await c.post("/aotx/v1/requests", content=b"{not json",
                         headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and error(r)["message"] == "the body is not valid JSON"

    gw(test)


def test_a_json_route_reads_a_json_object_whatever_its_content_type(gw: Any) -> None:
    """``curl -d`` sends a form's Content-Type: the body is still read as JSON (as
    llama.cpp's server and Ollama read it); what is not a JSON object is a 400 that
    says so, on every route that takes a JSON body, before its token is read."""
    refusals = {b"": "the body is empty; send a JSON object", b" \n": "the body is empty; "
                "send a JSON object", b"[1]": "the body must be a JSON object, not an array",
                b'"hi"': "the body must be a JSON object, not a string",
                b"null": "the body must be a JSON object, not null",
                b"{'a': 1}": "the body is not valid JSON", b"\xff{}": "the body is not valid JSON",
                b"[" * 100_000: "the body's JSON is nested too deeply to read",
                b"[" * 5000 + b"]" * 5000: "the body's JSON is nested too deeply to read"}
    types = (None, "application/json", "application/x-www-form-urlencoded", "text/plain")

    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        paths = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                 "/aotx/v1/requests", "/aotx/v1/policy")
        for path in paths:
            for body, message in refusals.items():
                for ctype in types:
                    headers = {"Content-Type": ctype} if ctype else {}
                    for auth in ({}, {"Authorization": "Bearer nope"}):
                        r = await c.post(path, content=body, headers={**headers, **auth})
                        assert (r.status_code, error(r)["message"]) == (400, message), (
                            path, body[:9], ctype, auth)
        broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
        for ctype in types:
            headers = {"Content-Type": ctype} if ctype else {}
            r = await c.post("/aotx/v1/requests", content=json.dumps(BODY), headers=headers)
            assert r.status_code == 202 and r.json()["id"] == RID, (ctype, r.text)
            # Past the guard, FastAPI validates the object the guard read.
            r = await c.post("/v1/embeddings", content=b'{"model": "smollm2", "input": 5}',
                             headers=headers)
            assert (r.status_code, error(r)["param"]) == (400, "input"), (ctype, r.text)

    gw(test)


def test_a_validation_error_names_the_field_the_caller_wrote(gw: Any) -> None:
    """A value that fits none of a union's members is named by its field, not by
    pydantic's member labels (``messages.0.content.str``), and the message says what
    the members take; a value that fits a member's type is named where inside it the
    error is; a query parameter by its own name."""
    chat = {**BODY, "messages": [{"role": "user", "content": 5}]}
    part = {**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    cases = [
        ("/v1/chat/completions", chat, "messages.0.content",
         "Input should be a string or an array, not an integer"),
        ("/aotx/v1/requests", part, "messages.0.content.0.text", "Input should be a valid string"),
        ("/v1/chat/completions", {**BODY, "messages": [{"role": "user", "content": [
            {"type": "txt", "text": "a"}]}]}, "messages.0.content.0",
         'unknown type "txt"; expected one of "text", "input_image", "input_audio", "image_url"'),
        ("/v1/chat/completions", {**BODY, "tool_choice": "maybe"}, "tool_choice",
         "Input should be 'none', 'auto', 'required' or an object, not \"maybe\""),
        ("/v1/embeddings", {"model": "smollm2", "input": [5.5]}, "input.0",
         "Input should be a string, an integer or an array, not a number"),
        ("/v1/responses", {"model": "smollm2", "input": [{"type": "mess"}]}, "input.0",
         'unknown type "mess"; expected one of "message", "function_call", '
         '"function_call_output", "reasoning"'),
        ("/v1/responses", {"model": "smollm2", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": 5}]}]}, "input.0.content.0.text",
         "Input should be a valid string"),
        # JSON's NaN and Infinity (Python's reader takes them) are not numbers here
        ("/v1/chat/completions", {**BODY, "temperature": float("nan")}, "temperature",
         "Input should be a finite number"),
        ("/v1/completions", {"model": "smollm2", "prompt": "a", "top_p": float("inf")},
         "top_p", "Input should be a finite number"),
    ]

    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        for path, body, param, message in cases:
            r = await c.post(path, content=json.dumps(body),  # NaN as JSON writes it
                             headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert (error(r)["param"], error(r)["message"]) == (param, f"{param}: {message}")
        r = await c.get("/v1/responses/resp_x/input_items?limit=many")
        assert (r.status_code, error(r)["param"]) == (400, "limit"), r.text
        assert error(r)["message"].startswith("limit: ")

    gw(test)


def test_the_guard_refuses_foreign_hosts_and_large_bodies(gw: Any) -> None:
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        r = await c.get("/v1/models", headers={"Host": "evil.example:8000"})
        assert r.status_code == 421 and "loopback" in error(r)["message"]
        # Only exactly a loopback name and a numeric port: nothing a looser reading
        # (split at the last ":", strip brackets) would take for loopback.
        for host in ("127.0.0.1:80@evil", "127.0.0.1@evil", "localhost.evil", "localhost.",
                     "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:80:80", "::1", "[::1]evil",
                     "127.0.0.1,evil", "127.0.0.2", "evil:127.0.0.1", ""):
            r = await c.get("/v1/models", headers={"Host": host})
            assert r.status_code == 421, host
            assert error(r)["code"] == "misdirected_request"
        for host in ("127.0.0.1", "127.0.0.1:8000", "LocalHost:1", "localhost", "[::1]",
                     "[::1]:65535"):
            assert (await c.get("/v1/models", headers={"Host": host})).status_code == 200, host
        r = await c.post("/v1/chat/completions", content=b"x" * (Settings().max_body + 1),
                         headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.headers["connection"] == "close"

    gw(test)


def test_a_path_with_a_slash_too_many_or_too_few_is_a_404(gw: Any) -> None:
    """No redirect (Starlette's would come before authentication, with a Location built
    from the Host header): the standard 404, with or without a token."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        for method, path in (("GET", "/aotx/v1/capabilities/"), ("GET", "/healthz/"),
                             ("POST", "/v1/chat/completions/"), ("GET", "/console"),
                             ("DELETE", "/aotx/v1/memory/")):
            for headers in ({}, {"Authorization": ""}):
                r = await c.request(method, path, headers=headers)
                assert r.status_code == 404, (method, path, r.status_code)
                assert "location" not in r.headers and error(r)["type"] == "not_found_error"
        assert (await c.get("/console/")).status_code == 200
        assert all(m.router.redirect_slashes is False for m in (
            routes_media, routes_native, routes_openai, routes_ops, routes_policy))

    gw(test)


def test_device_reasons_are_worded_by_the_gateway(gw: Any) -> None:
    """The device sends a status, a reason and a number; the gateway's table words them
    (with what it knows of the call), and a 429 carries Retry-After."""
    cases: list[tuple[Answer, int, str, str | None]] = [
        (lambda h, p: (h.refuse(429, wire.Reason.RATE_LIMIT, 5, 7, epoch=EPOCH), b""),
         429, "the grant allows 5 admissions a minute", None),
        (lambda h, p: (h.refuse(400, wire.Reason.OUTPUT_TOKENS, 64, epoch=EPOCH), b""),
         400, "max_tokens 100 exceeds the limit of 64", "max_tokens"),
        (lambda h, p: (h.refuse(400, wire.Reason.PROMPT_LENGTH, 2047, epoch=EPOCH,
                                prompt_tokens=3000), b""),
         400, "the prompt has 3000 tokens; model smollm2 accepts at most 2047 so that one "
              "can be generated", "messages"),
        (lambda h, p: (h.refuse(413, wire.Reason.INPUT_BYTES, 10, epoch=EPOCH), b""),
         413, f"input of {len(p_of())} bytes exceeds the grant's 10", "messages"),
        (lambda h, p: (h.refuse(403, wire.Reason.ACTION, int(wire.Action.SUBMIT), epoch=EPOCH),
                       b""), 403, "the grant does not include the submit action", None),
        (lambda h, p: (h.refuse(403, wire.Reason.ACTION, int(wire.Action.POLICY_READ
                                                             | wire.Action.POLICY_CONTROL),
                                epoch=EPOCH), b""),
         403, "the grant does not include the policy-read or policy-control action", None),
    ]

    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        for answer, status, message, param in cases:
            broker.script[wire.Op.SUBMIT] = answer
            r = await c.post("/aotx/v1/requests", json=BODY)
            assert r.status_code == status, r.text
            assert (error(r)["message"], error(r)["param"]) == (message, param)
            if status == 429:
                assert r.headers["retry-after"] == "7"

    gw(test)


def test_an_unlisted_status_has_a_word_for_its_code(gw: Any) -> None:
    """A status the errors table does not list (a device status the gateway does not
    know yet) gets its reason phrase as its code, never the number."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        broker.script[wire.Op.SUBMIT] = lambda h, p: (
            h.refuse(507, wire.Reason.INTERNAL, epoch=EPOCH), b"")
        r = await c.post("/aotx/v1/requests", json=BODY)
        assert r.status_code == 507 and error(r)["code"] == "insufficient_storage"

    gw(test)
    for status in range(400, 600):
        code = error_body(status, "x")["error"]["code"]
        assert re.fullmatch(r"[a-z][a-z_]*[a-z]", code), (status, code)


BODY = {"model": "smollm2", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}


def test_a_bad_stop_is_reported_as_stop(gw: Any) -> None:
    """Whatever is wrong with ``stop`` (its type, count, length, a lone surrogate), the
    error's param is "stop", on both routes (and past the admission fast path); a lone
    surrogate in a message is the messages' fault."""
    stops = ['5', '[5]', '["a", 3]', '{}', 'true', json.dumps(["a"] * 17), '[""]',
             json.dumps("x" * (wire.MAX_STOP_BYTES + 1)), '"\\ud800"', '["a", "\\udc00b"]']

    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
        json_type = {"Content-Type": "application/json"}
        for path in ("/aotx/v1/requests", "/v1/chat/completions"):
            for stop in stops:
                body = json.dumps(BODY)[:-1] + f', "stop": {stop}}}'
                r = await c.post(path, content=body, headers=json_type)
                assert (r.status_code, error(r)["param"]) == (400, "stop"), (path, stop, r.text)
            body = json.dumps({**BODY, "messages": [{"role": "user", "content": "x"}]})
            r = await c.post(path, content=body.replace('"x"', '"\\ud800"'), headers=json_type)
            assert (r.status_code, error(r)["param"]) == (400, "messages"), r.text
        assert not any(h.op == wire.Op.SUBMIT for h in broker.sent)

    gw(test)


def p_of() -> bytes:
    """The submission payload BODY becomes (what INPUT_BYTES compares)."""
    return wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.TEXT, b"hi"),)),)))


def test_handles_cursors_and_epochs(gw: Any) -> None:
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        assert (await c.get("/aotx/v1/requests/req-nothing")).status_code == 404
        broker.script[wire.Op.READ] = lambda h, p: (
            h.refuse(409, wire.Reason.CURSOR, epoch=EPOCH, total=12), b"")
        r = await c.get(f"/aotx/v1/requests/{RID}", params={"cursor": "99"})
        assert r.status_code == 409
        assert error(r)["message"] == "cursor 99 is past the 12 bytes produced so far"
        broker.script[wire.Op.READ] = lambda h, p: (
            h.refuse(410, wire.Reason.EPOCH_ENDED, epoch=EPOCH), b"")
        r = await c.get(f"/aotx/v1/requests/{RID}")
        assert r.status_code == 410 and error(r)["type"] == "gone_error"
        for bad in ("-1", "1e3", "²", str(1 << 64)):
            r = await c.get(f"/aotx/v1/requests/{RID}", params={"cursor": bad})
            assert r.status_code == 400 and error(r)["param"] == "cursor", bad

    gw(test)


def test_event_stream_rules(gw: Any) -> None:
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        path = f"/aotx/v1/requests/{RID}/events"
        r = await c.get(path, params={"cursor": "0"}, headers={"Last-Event-ID": f"{RID}:0"})
        assert r.status_code == 400 and error(r)["param"] == "cursor"
        other = ids.format_request_id(EPOCH, bytes(16))
        for last in (f"{other}:0", "garbage", f"{RID}:x"):
            r = await c.get(path, headers={"Last-Event-ID": last})
            assert r.status_code == 400, last
        broker.script[wire.Op.READ] = lambda h, p: (
            state(h, phase=wire.Phase.COMPLETED, total=3, finish=1), b"abc"[h.cursor:])
        r = await c.get(path, headers={"Last-Event-ID": f"{RID}:1"})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0].startswith("event: emission\n") and f"id: {RID}:3" in events[0]
        assert events[-1].startswith("event: status\n") and len(events) == 2
        r = await c.post("/aotx/v1/requests", json={**BODY, "stream": True})
        assert r.status_code == 400 and error(r)["param"] == "stream"

    gw(test)


def test_a_failed_request_reads_as_failed_and_completes_as_its_status(gw: Any) -> None:
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        failed = state(wire.Header(op=wire.Op.READ), phase=wire.Phase.FAILED, failure=503,
                       reason=int(wire.Reason.KV_FULL))
        broker.script[wire.Op.READ] = lambda h, p: (failed._replace(tag=h.tag), b"")
        doc = (await c.get(f"/aotx/v1/requests/{RID}")).json()
        assert doc["state"] == "failed" and doc["failure"]["type"] == "service_unavailable"
        assert doc["failure"]["message"] == "the engine ran out of KV cache for this request"
        broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
        r = await c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and "KV cache" in error(r)["message"]

    gw(test)


def test_policy_conflicts_and_memory_paths(gw: Any) -> None:
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        status = wire.encode_policy_status(wire.PolicyStatus(state=wire.PolicyState.QUIET,
                                                             control_revision=9))
        broker.script[wire.Op.POLICY] = lambda h, p: (
            h.refuse(409, wire.Reason.STALE_REVISION, 9, epoch=EPOCH), status)
        r = await c.post("/aotx/v1/policy", json={"action": "pause", "expected_revision": "3"})
        assert r.status_code == 409
        assert error(r)["message"] == "stale control revision 3; the current one is 9"
        broker.script[wire.Op.POLICY] = lambda h, p: (
            h.refuse(409, wire.Reason.POLICY_OFF, epoch=EPOCH), status)
        r = await c.post("/aotx/v1/policy", json={"action": "pause", "expected_revision": "9"})
        assert r.status_code == 409 and "policy is off" in error(r)["message"]
        for path in ("/aotx/v1/memory/pending/1/maybe", "/aotx/v1/memory/pending/x/approve",
                     f"/aotx/v1/memory/pending/{1 << 63}/approve"):
            assert (await c.post(path)).status_code == 404, path
        assert not any(h.op == wire.Op.MEMORY for h in broker.sent)  # refused in the gateway

    gw(test)


def test_telemetry_values_are_decimal_strings(gw: Any) -> None:
    """'The sample contains service allocation bytes, device tick and device clock
    nanoseconds as decimal strings.'"""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        big = (1 << 64) - 1
        broker.script[wire.Op.TELEMETRY] = lambda h, p: (
            h.reply(200, epoch=EPOCH), wire.encode_telemetry(wire.Telemetry(big, 7, 12345)))
        doc = (await c.get("/aotx/v1/telemetry")).json()
        assert doc["sample"] == {"service_allocation_bytes": str(big), "device_tick": "7",
                                 "device_clock_ns": "12345"}
        assert doc["runtime_epoch"] == str(EPOCH)
        assert doc["affect"] is None and doc["expression"] is None

    gw(test)


def test_an_unreachable_device_is_a_plain_503(gw: Any) -> None:
    """No filesystem path in the body: the detail goes to the gateway's log."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        broker.down = True
        r = await c.post("/aotx/v1/requests", json=BODY)
        assert r.status_code == 503 and "/" not in error(r)["message"]
        assert "not reachable" in error(r)["message"]

    gw(test)


ROUTES = [("POST", "/v1/chat/completions", BODY), ("POST", "/aotx/v1/requests", BODY),
          ("GET", "/v1/models", None), ("GET", "/v1/models/smollm2", None),
          ("GET", "/aotx/v1/capabilities", None), ("GET", f"/aotx/v1/requests/{RID}", None),
          ("GET", f"/aotx/v1/requests/{RID}/events", None),
          ("POST", f"/aotx/v1/requests/{RID}/cancel", None), ("GET", "/aotx/v1/telemetry", None),
          ("GET", "/metrics", None), ("GET", "/aotx/v1/media", None),
          ("GET", "/aotx/v1/policy", None), ("GET", "/aotx/v1/memory", None)]


def test_an_unreachable_broker_shows_no_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real broker client with no broker behind its socket: no socket file, then one
    nobody listens on, then no file descriptor left for a socket.  Every route answers
    the plain 503: the socket's path, its name and the OS error stay in the log."""
    state = short_tmpdir()
    paths = RuntimePaths(state)
    app = create_app(paths, Settings())

    def no_fd(*args: Any) -> socket.socket:
        raise OSError(24, f"Too many open files: {paths.socket}")

    async def routes(c: httpx.AsyncClient) -> None:
        for method, path, body in ROUTES:
            r = await c.request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert error(r)["message"] == "the device is not reachable; try again"
            for leak in ("/", "sock", "rrno", "No such file", "refused", "open files", state):
                assert leak not in r.text, (path, leak, r.text)
        r = await c.get("/readyz")
        assert r.status_code == 503 and "/" not in r.text

    async def run() -> None:
        async with asgi_client(app, paths) as c:
            await routes(c)
            paths.ensure()  # a socket file left behind by a broker that is gone
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.bind(paths.socket)
            await routes(c)
            with monkeypatch.context() as m:
                m.setattr(broker_client.socket, "socket", no_fd)
                await routes(c)

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_a_submission_over_one_packet_is_worded_by_the_table(gw: Any) -> None:
    """The codec's own message (how many bytes it counted) is for a log: the client gets
    the errors table's wording, as when the device refuses a packet."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 70_000}]}
        for path in ("/aotx/v1/requests", "/v1/chat/completions"):
            r = await c.post(path, json=big)
            assert r.status_code == 413, r.text
            assert error(r)["message"] == (
                "the request does not fit one packet: its encoded content may be at most "
                f"{wire.MAX_PAYLOAD} bytes (max_payload_bytes)")
            assert wire.MAX_PAYLOAD == 65_408  # what docs/api.md and capabilities say

    gw(test)


def test_a_silent_device_is_a_503_within_the_operation_deadline(gw: Any) -> None:
    """Each call carries its operation's deadline (a WAIT's: its own wait plus the margin);
    one that runs out is a 503 with a fixed message."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        d = Settings()
        broker.script[wire.Op.READ] = lambda h, p: (state(h, total=0), b"")
        broker.script[wire.Op.WAIT] = lambda h, p: (
            state(h, phase=wire.Phase.COMPLETED, total=0, finish=1), b"")
        r = await c.get(f"/aotx/v1/requests/{RID}/events")  # a READ, a WAIT, the end
        assert r.status_code == 200 and "event: status" in r.text
        wait = next(h for h in reversed(broker.sent) if h.op == wire.Op.WAIT)
        assert broker.timeouts[wire.Op.WAIT] == wait.wait_ms / 1000 + d.wait_margin
        assert broker.timeouts[wire.Op.READ] == d.call_deadline

        def silent(h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
            raise DeviceSilent("no reply to op 2 in 5 s")

        broker.script[wire.Op.SUBMIT] = silent
        for route in ("/aotx/v1/requests", "/v1/chat/completions"):
            r = await c.post(route, json=BODY)
            assert r.status_code == 503, r.text
            assert error(r)["message"] == "the device did not answer in time; try again"
        assert broker.timeouts[wire.Op.SUBMIT] == d.call_deadline  # text: no media worker

    gw(test)


def test_an_unexpected_failure_is_a_plain_500(gw: Any) -> None:
    """An exception the gateway does not expect (a bug), in a route or a fast path: the
    standard object with a fixed message; its text (here a path) stays in the log."""
    def boom(h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
        raise RuntimeError("/secret/run/service.sock: boom")

    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        for op in (wire.Op.SUBMIT, wire.Op.READ, wire.Op.TELEMETRY):
            broker.script[op] = boom
        for method, path, body in (("POST", "/v1/chat/completions", BODY),
                                   ("POST", "/aotx/v1/requests", BODY),  # fast path
                                   ("GET", f"/aotx/v1/requests/{RID}", None),  # fast path
                                   ("GET", "/aotx/v1/telemetry", None)):
            r = await c.request(method, path, json=body)
            assert r.status_code == 500, (path, r.text)
            assert error(r)["code"] == "internal_error" and "gateway" in error(r)["message"]
            assert "secret" not in r.text and "boom" not in r.text

    gw(test, False)


def test_after_a_500_a_pooled_client_goes_on(served: Served) -> None:
    """uvicorn closes the connection after an exception the app re-raises; the 500 says
    ``Connection: close``, so a pooled client opens a new connection for its next
    request instead of failing on the closed one (issue 39)."""
    def boom(h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
        raise RuntimeError("boom")

    served.broker.script[wire.Op.TELEMETRY] = boom
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", timeout=10,
                      headers={"Authorization": f"Bearer {served.token}"}) as c:
        for _ in range(3):
            r = c.get("/aotx/v1/telemetry")
            assert r.status_code == 500 and r.headers["connection"] == "close"
            assert c.get("/v1/models").status_code == 200  # (not a reset)


def test_the_fast_paths_answer_as_the_routes(gw: Any) -> None:
    """The guard answers a valid admission, a window read and the model list itself; the
    same requests through the routes (a body the fast path passes on) answer alike."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        fast, routed = await c.get("/v1/models"), await c.request("GET", "/v1/models", content=b"{}")
        assert fast.status_code == routed.status_code == 200
        assert fast.json() == routed.json() and fast.json()["data"][0]["id"] == "smollm2"
        assert fast.headers["content-type"] == routed.headers["content-type"]
        for path in ("/v1/models", "/v1/models/smollm2"):
            refused = await c.get(path, headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401 and error(refused)["code"] == "invalid_api_key"

        broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
        fast = await c.post("/aotx/v1/requests", json=BODY)
        routed = await c.post("/aotx/v1/requests", content=httpx.Request(
            "POST", "http://x", json=BODY).read(), headers={"Content-Type": "application/json; x=1"})
        assert fast.status_code == routed.status_code == 202
        assert fast.json() == routed.json() and fast.json()["id"] == RID
        assert fast.json()["media"] == []

    gw(test)



def test_the_guard_is_the_one_path_of_its_routes() -> None:
    """The window read, the model list, admissions and chat completions are answered by
    the guard alone: whole, streamed, refused, with an invalid body (its credentials
    checked first, then the same 400 as any route's validation), with a form's
    Content-Type; their FastAPI declarations, reached without the guard, are never a
    path (a 500: guard_only)."""
    state_dir = short_tmpdir()
    broker = ScriptedBroker()
    broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
    broker.script[wire.Op.READ] = lambda h, p: (
        state(h, phase=wire.Phase.COMPLETED, total=3, finish=1), b"abc"[h.cursor:])
    app = create_app(RuntimePaths(state_dir), Settings(), broker=broker)  # type: ignore[arg-type]

    async def run() -> None:
        async with asgi_client(app, RuntimePaths(state_dir)) as c:
            whole = await c.post("/v1/chat/completions", json=BODY)
            assert whole.status_code == 200 and whole.json()["choices"][0]["message"][
                "content"] == "abc"
            stream = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
            assert "data: [DONE]" in (await c.post("/v1/chat/completions", json=stream)).text
            refused = await c.post("/v1/chat/completions", json={**BODY, "model": "nope"})
            assert refused.status_code == 404 and "nope" in error(refused)["message"]
            for path in ("/v1/chat/completions", "/aotx/v1/requests"):
                bad = await c.post(path, json={**BODY, "max_tokens": "many"})
                assert bad.status_code == 400 and error(bad)["param"] == "max_tokens", bad.text
                anon = await c.post(path, json={**BODY, "max_tokens": "many"},
                                    headers={"Authorization": ""})
                assert anon.status_code == 401  # credentials before the body
                form = await c.post(path, content=orjson.dumps(BODY),
                                    headers={"Content-Type": "application/x-www-form-urlencoded"})
                assert form.status_code in (200, 202), form.text
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "smollm2"
            rid = form.json()["id"]
            assert (await c.get(f"/aotx/v1/requests/{rid}")).json()["state"] == "completed"
            bare = httpx.AsyncClient(transport=httpx.ASGITransport(
                app=app.app, raise_app_exceptions=False),  # type: ignore[attr-defined]
                base_url="http://127.0.0.1", headers=c.headers)
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                 ("POST", "/aotx/v1/requests"),
                                 ("GET", f"/aotx/v1/requests/{rid}")):
                r = await bare.request(method, path, json=BODY if method == "POST" else None)
                assert r.status_code == 500 and error(r)["message"] == INTERNAL, (path, r.text)
            await bare.aclose()

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def test_a_malformed_request_answers_the_standard_error_object(served: Served) -> None:
    """Bytes the HTTP parser refuses: a JSON 400 that says nothing of the parser (not
    uvicorn's text/plain "Invalid HTTP request received."), and the connection closes."""
    for data in (b"\x00\x01garbage\r\n\r\n",
                 b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
                 b"GET /healthz HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n",
                 b"GET /health z HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"):
        answer = served.raw(data)
        status, err = raw_error(answer)
        assert status == 400 and b"connection: close" in answer.lower(), data
        assert err == {"message": "the request is not valid HTTP/1.1",
                       "type": "invalid_request_error", "code": "invalid_request",
                       "param": None}


def test_request_targets_and_host_headers_on_the_wire(served: Served) -> None:
    """What only raw requests can send: an absolute-form target names its own host (RFC
    9112 3.2.2: it stands for the Host header, which is ignored), so it is checked as
    the Host is; user information in it, another form of target, no Host or two: 400;
    HTTP/2.0: 505; a path that spells / as %2F: 404."""
    def status(target: bytes, *headers: bytes, version: bytes = b"1.1") -> int:
        answer = served.raw(b"GET %s HTTP/%s\r\n%sConnection: close\r\n\r\n"
                            % (target, version, b"".join(h + b"\r\n" for h in headers)))
        if answer.startswith(b"HTTP/1.1 200"):
            return 200
        return raw_error(answer)[0]

    local = b"Host: 127.0.0.1"
    assert status(b"/healthz", local) == 200
    assert status(b"http://127.0.0.1/healthz", b"Host: evil.example") == 200
    assert status(b"HTTP://[::1]:%d/healthz?x=1" % served.port, local) == 200
    assert status(b"http://evil.example/healthz", local) == 421
    assert status(b"http://evil.example:80/healthz") == 421
    assert status(b"http://127.0.0.1.evil.example/healthz", local) == 421
    for target in (b"http://127.0.0.1:80@evil.example/healthz", b"http://u:p@127.0.0.1/healthz",
                   b"ftp://127.0.0.1/healthz", b"evil.example:443", b"*", b"http://127.0.0.1"):
        assert status(target, local) == 400, target
    assert status(b"/healthz", b"Host: 127.0.0.1:80@evil.example") == 421
    assert status(b"/healthz", local, b"Host: evil.example") == 400
    assert status(b"/healthz") == 400
    assert status(b"/healthz", version=b"1.0") == 421  # 1.0 may omit Host; not loopback
    assert status(b"/healthz", local, version=b"2.0") == 505  # the parser lets 2.0 through
    # a path spelled with %2F is no route's, before the token: decoded, it would be one
    assert status(b"/v1/models", local) == 401
    for target in (b"/v1%2Fmodels", b"/v1%2fmodels", b"/aotx/v1/requests/x%2Fevents"):
        assert status(target, local) == 404, target
    assert status(b"/v1/models/org%2Fm2", local) == 401  # an alias may hold a / (encoded)


def test_every_timeout_answers_408_request_timeout(served: Served) -> None:
    """Headers that never end, a JSON body that stalls, an upload that stalls: each a 408
    whose code is the word request_timeout, and the connection closes."""
    served.broker.script[wire.Op.MEDIA_PUT] = lambda h, p: (h.reply(200, epoch=EPOCH), b"")
    for data in (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{}",
                 b"POST /aotx/v1/media HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                 + served.token.encode() + b"\r\nContent-Type: image/png\r\n"
                 b"Content-Length: 100\r\n\r\n\x89PNG"):
        answer = served.raw(data)
        status, err = raw_error(answer)
        assert (status, err["code"], err["type"]) == (408, "request_timeout",
                                                      "invalid_request_error"), data
        assert b"connection: close" in answer.lower()



def test_an_upgrade_is_plain_http(served: Served, caplog: pytest.LogCaptureFixture,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No route speaks WebSocket: a handshake is a plain HTTP request, so it meets the
    Guard (here its Host check: a 421 object, not a bare 403 from a WebSocket protocol
    the Guard never saw), and an Upgrade header costs no warning line in the log."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(logging.getLogger("uvicorn"), "propagate", True)  # to caplog
    handshake = (b"GET /healthz HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\n"
                 b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    assert raw_error(served.raw(handshake % b"evil.example"))[0] == 421
    for upgrade in (b"websocket", b"h2c"):
        answer = served.raw(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: "
                            b"Upgrade, close\r\nUpgrade: %s\r\n\r\n" % upgrade)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_stream_waiting_for_its_model_says_so_in_comments(gw: Any) -> None:
    """While the request waits for its model's load (preparing), each keep-alive tick of
    a chat stream is an SSE comment (a proxy sees bytes); then the chunks follow."""
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        waits = []

        def wait(h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
            waits.append(h)
            if len(waits) < 3:  # two ticks: the load goes on
                return state(h, phase=wire.Phase.PREPARING), b""
            return state(h, phase=wire.Phase.COMPLETED, total=3, finish=1), b"abc"

        broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.PREPARING), b"")
        broker.script[wire.Op.READ] = lambda h, p: (state(h, phase=wire.Phase.PREPARING), b"")
        broker.script[wire.Op.WAIT] = wait
        text = (await c.post("/v1/chat/completions", json={**BODY, "stream": True})).text
        events = [e for e in text.split("\n\n") if e]
        comments = [e for e in events if e.startswith(":")]
        # each tick while preparing (not the first read: a change); none once it answers
        assert comments == [": preparing"] * 2
        assert events.index(comments[-1]) < next(i for i, e in enumerate(events)
                                                 if '"abc"' in e)
        assert events[-1] == "data: [DONE]"

    gw(test)
