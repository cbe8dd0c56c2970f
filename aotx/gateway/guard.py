"""The request guard: every limit on HTTP requests that uvicorn and FastAPI alone do not
give, and the hottest routes' only path.  (The connection level is connection.py's.)

Request level (:class:`Guard`, ASGI middleware in front of every route): one Host
header, a loopback one on a loopback bind, body size and pacing (each chunk within
``body_timeout``), a JSON route's body a JSON object whatever its Content-Type, and the
one path of ``GET /aotx/v1/requests/{id}``, ``GET /v1/models``,
``POST /aotx/v1/requests`` and ``POST /v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import MAX_BODY
from . import anthropic, calls, choices, routes_openai
from .errors import (
    NO_BODY,
    NOT_AN_OBJECT,
    NOT_JSON,
    TOO_DEEP,
    ApiError,
    error_body,
)
from .render import dumps, failure_response, invalid_body, send_json
from .requests import ChatRequest
from .validation import kind_of

if TYPE_CHECKING:
    from .service import Gateway, Principal

log = logging.getLogger("aotx.gateway.http")

#: A Host naming loopback: exactly one of these names, then at most a numeric port.
#: Nothing looser: a check that splits or strips the value can take one that names
#: another host ("127.0.0.1:80@evil", "localhost.evil") for loopback.
LOOPBACK_HOST = re.compile(r"(?:127\.0\.0\.1|localhost|\[::1\])(?::[0-9]{1,5})?", re.IGNORECASE)
_WINDOW_PATH = re.compile(r"^/aotx/v1/requests/[^/]+$")


def target_refusal(scope: Scope) -> tuple[int, str] | None:
    """(status, message) for a request line the routes must not see: another HTTP
    version than 1.0 or 1.1 (the parser reads "HTTP/2.0" as a version, not a refusal),
    or a path that spells ``/`` as ``%2F`` (the server decodes it, so
    ``/aotx/v1/requests/ID%2Fevents`` would reach the events route: paths match exactly,
    in one spelling).  Not in a model's alias, which may hold a ``/`` and which a client
    may encode (``/v1/models/org%2Fm2``): that route takes the rest of the path whole."""
    if scope.get("http_version", "1.1") not in ("1.0", "1.1"):
        return 505, "this service speaks HTTP/1.1"
    raw = (scope.get("raw_path") or b"").lower()
    if b"%2f" in raw and not raw.startswith(b"/v1/models/"):
        return 404, "a path may not spell / as %2F"
    return None


def host_refusal(scope: Scope, loopback_only: bool) -> tuple[int, str] | None:
    """(status, message) when the request's Host header is refused, else None.

    RFC 9112 3.2: an HTTP/1.1 request has exactly one Host header (else 400).  While
    bound to loopback, only a loopback Host is served (else 421): a page whose name
    resolves to 127.0.0.1 must not reach the API (DNS rebinding)."""
    hosts = [v for k, v in scope["headers"] if k == b"host"]
    if len(hosts) > 1 or (not hosts and scope.get("http_version", "1.1") == "1.1"):
        return 400, "a request must carry exactly one Host header"
    host = hosts[0].decode("latin-1") if hosts else ""
    if loopback_only and not LOOPBACK_HOST.fullmatch(host):
        return 421, (f"the Host header {host!r} is not a loopback name; this service only "
                     "answers 127.0.0.1, localhost or [::1]")
    return None


class Guard:
    """ASGI middleware in front of every route.

    * One Host header (400 otherwise); while bound to loopback, it must be exactly a
      loopback name with an optional port, else 421 (DNS rebinding: a page from another
      origin that resolves its own name to 127.0.0.1 must not reach the API).
    * Request bodies: at most ``limit`` bytes (413), and each chunk must arrive within
      ``body_timeout`` seconds (408), so slow clients cannot hold a request open for
      ever.  Bodies are read in full before the route runs, except media uploads,
      which stream to the device chunk by chunk under the same pacing.
    * A POST to one of ``json_paths`` (the routes that take a JSON body) must carry a
      JSON object: an empty body, invalid JSON or another JSON value is a 400 before the
      token is read (docs/api.md, "Order of checks").  The object is read as JSON
      whatever the Content-Type says, as llama.cpp's server and Ollama read it, so
      ``curl -d '{...}'`` (which sends a form's type) works.
    * The window read, the model list, admissions and chat completions are answered
      here, their one path, without the framework's routing and dependency layers.
    """

    def __init__(self, app: ASGIApp, loopback_only: bool, gateway: Callable[[], Gateway],
                 limit: int = MAX_BODY, body_timeout: float = 30.0,
                 json_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.gateway = gateway
        self.limit = limit
        self.body_timeout = body_timeout
        self.json_paths = json_paths

    # -- the routes answered here, and only here ------------------------------------------
    # GET /aotx/v1/requests/{id}, GET /v1/models, POST /aotx/v1/requests and POST
    # /v1/chat/completions: the framework's routing and dependency layers cost more than
    # these answers (~40 % of the gateway's CPU for an admission), so the guard is their
    # one path.  Their FastAPI declarations are their OpenAPI entries only.  What they
    # raise is answered by render.failure_response, as the app's handlers answer it;
    # their credentials are checked before their bodies, as a route's dependency is.

    async def _answer(self, scope: Scope, receive: Receive, send: Send,
                      answer: Callable[[Gateway, Principal],
                                       Awaitable[Response | tuple[int, bytes]]]) -> None:
        """Authenticate the caller, then send what ``answer(gateway, principal)`` gives: a
        response, or (status, JSON bytes) sent as two ASGI messages (a Response object
        costs more than these answers' own work)."""
        g = self.gateway()
        try:
            out = await answer(g, await g.authenticate(Request(scope)))
        except Exception as exc:
            if not isinstance(exc, ApiError):
                log.exception("event=gateway.error")
            out = failure_response(exc)
        if isinstance(out, tuple):
            await send_json(send, *out)
        else:
            await out(scope, receive, send)

    async def _window(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /aotx/v1/requests/{id}: a window of the request's output."""
        async def window(g: Gateway, principal: Principal) -> tuple[int, bytes]:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"),
                             keep_blank_values=True)
            cursor = query.get("cursor", [None])[-1]
            return 200, await calls.window_body(
                g, principal, scope["path"][len("/aotx/v1/requests/"):], cursor)

        await self._answer(scope, receive, send, window)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /v1/models, which clients and load balancers poll."""
        async def models(g: Gateway, principal: Principal) -> tuple[int, bytes]:
            return 200, await routes_openai.models_body(g, principal)

        await self._answer(scope, receive, send, models)

    async def _submit(self, scope: Scope, body: dict[str, Any], receive: Receive,
                      send: Send) -> None:
        """POST /aotx/v1/requests: an admission."""
        async def admit(g: Gateway, principal: Principal) -> tuple[int, bytes]:
            return 202, await calls.admission_body(g, _chat_request(body), principal)

        await self._answer(scope, receive, send, admit)

    async def _chat(self, scope: Scope, body: dict[str, Any], receive: Receive,
                    send: Send) -> None:
        """POST /v1/chat/completions: the answer, or its stream."""
        async def complete(g: Gateway, principal: Principal) -> Response:
            return await choices.completion(g, _chat_request(body), principal)

        await self._answer(scope, receive, send, complete)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in anthropic.PATHS:  # its errors in Anthropic's envelope
            send = anthropic.enveloped(send)
        if (refused := target_refusal(scope)
                or host_refusal(scope, self.loopback_only)) is not None:
            await self._refuse(send, *refused)
            return
        streamed = (scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS")
                    or scope["path"] == "/aotx/v1/media")
        has_body = any(k == b"transfer-encoding" or (k == b"content-length" and v.strip(b" 0"))
                       for k, v in scope["headers"])
        if scope["method"] == "GET" and (_WINDOW_PATH.match(scope["path"])
                                         or scope["path"] == "/v1/models"):
            if has_body:  # (never read: the connection closes after the answer)
                receive, send = self._close_unless_read(receive, send)
            await (self._models if scope["path"] == "/v1/models" else self._window)(
                scope, receive, send)
        elif streamed:
            await self._streamed(scope, receive, send, has_body)
        else:
            await self._buffered(scope, receive, send)

    def _paced(self, receive: Receive) -> Receive:
        async def paced() -> Any:
            try:
                return await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise BodyTimeout() from None

        return paced

    async def _streamed(self, scope: Scope, receive: Receive, send: Send, has_body: bool) -> None:
        """A route that reads its body as it comes (a media upload), or has none."""
        inner = self._paced(receive) if scope["method"] == "POST" else receive
        if has_body:
            inner, send = self._close_unless_read(inner, send)
        try:
            await self.app(scope, inner, send)
        except BodyTimeout:
            await self._refuse(send, 408, "the request body stalled")

    async def _buffered(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body (bounded, paced) before the route runs."""
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                await self._refuse(send, 413, f"request body exceeds {self.limit} bytes")
                return
        paced = self._paced(receive)
        chunks, size = [], 0
        while True:
            try:
                msg = await paced()
            except BodyTimeout:
                await self._refuse(send, 408, f"no body bytes for {self.body_timeout:.0f} s")
                return
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send, 413, f"request body exceeds {self.limit} bytes")
                return
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        if scope["method"] == "POST" and scope["path"] in self.json_paths:
            obj = json_object(body)
            if isinstance(obj, str):
                await send_json(send, 400, dumps(error_body(400, obj)))
                return
            if scope["path"] == "/aotx/v1/requests":
                await self._submit(scope, obj, receive, send)
                return
            if scope["path"] == "/v1/chat/completions":
                await self._chat(scope, obj, receive, send)
                return
            if not typed_json(scope):
                scope = as_json(scope)  # so that FastAPI's route parses it as JSON
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _close_unless_read(receive: Receive, send: Send) -> tuple[Receive, Send]:
        """For a request with a body the application may not read (a GET with a
        Content-Length, an upload refused before its body): a response that starts
        before the body ended says ``connection: close``.  Kept alive, the connection
        would wait for the rest of that body with no timer running."""
        done = False

        async def tracked() -> Any:
            nonlocal done
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body"):
                done = True
            return msg

        async def closing(message: Any) -> None:
            if message["type"] == "http.response.start" and not done:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"connection" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return tracked, closing

    @staticmethod
    async def _refuse(send: Send, status: int, message: str) -> None:
        await send_json(send, status, dumps(error_body(status, message)),
                        {"connection": "close"})


def json_object(body: bytes) -> dict[str, Any] | str:
    """The body as a JSON object, or the 400's message saying why it is not one."""
    if not body.strip():
        return NO_BODY
    try:
        value = json.loads(body)  # what FastAPI parses with: NaN and all
    except ValueError:
        return NOT_JSON
    except RecursionError:  # valid JSON, but deeper than Python's parser goes (~1000)
        return TOO_DEEP
    return value if isinstance(value, dict) else NOT_AN_OBJECT.format(kind=kind_of(value))


def typed_json(scope: Scope) -> bool:
    ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    return ctype.split(b";")[0].strip().lower() == b"application/json"


def as_json(scope: Scope) -> Scope:
    """``scope`` with its Content-Type ``application/json``, so that FastAPI parses the
    body as the JSON the guard found it to be (it leaves another type's bytes raw)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


class BodyTimeout(Exception):
    """A request body stalled for ``body_timeout`` (the route answers 408)."""


def _chat_request(body: dict[str, Any]) -> ChatRequest:
    """The body as ``ChatRequest``, or the 400 its route's validation would answer."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise invalid_body(ChatRequest, errors) from None
