"""The connection guard: every limit on HTTP connections and requests that uvicorn and
FastAPI alone do not give, and the hottest routes' fast paths.

Connection level (:class:`GuardedHttpToolsProtocol`, uvicorn's protocol class):

* **Header read timeout** (slow-loris): the request line and headers must
  arrive within ``header_timeout`` seconds of the connection opening (or of the
  first byte of the next request on a kept-alive connection), else 408 and close.
* **Header size**: more than ``MAX_HEADER_BYTES`` before the end of the headers
  answers 431 and closes.
* **Malformed requests**: bytes the HTTP parser refuses answer 400 with the standard
  error object (not uvicorn's text) and close.
* **Request targets**: a path, or an absolute ``http://host/path`` whose authority then
  stands for the Host header (RFC 9112 3.2.2); anything else answers 400.

Request level (:class:`Guard`, ASGI middleware in front of every route): one Host
header, a loopback one on a loopback bind, body size and pacing (each chunk within
``body_timeout``), a JSON route's body a JSON object whatever its Content-Type, and the
fast paths of ``GET /aotx/v1/requests/{id}``, ``GET /v1/models``,
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

import httptools
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..config import MAX_BODY
from . import calls, choices, routes_openai
from .errors import (
    INTERNAL,
    NO_BODY,
    NOT_AN_OBJECT,
    NOT_JSON,
    TOO_DEEP,
    ApiError,
    error_body,
)
from .render import dumps, error_response, json_response, send_json
from .requests import ChatRequest
from .validation import kind_of

if TYPE_CHECKING:
    from .service import Gateway

log = logging.getLogger("aotx.gateway.http")

MAX_HEADER_BYTES = 16 * 1024

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
NOT_HTTP = "the request is not valid HTTP/1.1"
#: An absolute-form request target: http(s), an authority without user information
#: (group 1), then the path and query.
_ABSOLUTE_FORM = re.compile(rb"https?://([^/?#@]*)(/[^#]*)", re.IGNORECASE)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout = 10.0  # set per server by guarded_protocol()
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _in_headers = True
    _refused = False
    _tail = b""  # the last bytes of the previous read while in headers

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if not self._in_headers:
            self._in_headers = True
            self._header_bytes = 0
            self._tail = b""
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout,
                                                     self._headers_too_slow)

    def _disarm(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        self._refused = True
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            # A pipelined request refused while the previous response is still being
            # written (an event stream): a raw answer would land inside that response.
            self.transport.close()
            return
        body = dumps(error_body(status, message))
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n"
                             % (status, _REASONS[status], len(body)) + body)
        self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            log.debug("event=gateway.header_timeout client=%s", self.client)
            self._refuse(408, f"request headers not received within {self.header_timeout:.0f} s")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            # Count raw bytes up to the end of the headers (a body may share the chunk,
            # and the blank line may be split across two reads); this bounds what the
            # parser buffers before it reports a header.
            end = (self._tail + data).find(b"\r\n\r\n")
            if end < 0:
                self._header_bytes += len(data)
                self._tail = (self._tail + data)[-3:]
            else:
                self._header_bytes += max(0, end - len(self._tail))
                self._in_headers = False  # until the next request begins
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
                return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, but bytes the parser refuses get the standard
        error object, and its complaint goes to the debug log: anyone who can reach the
        port can send garbage, and a warning line for each would let them fill the log."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            log.debug("event=gateway.bad_request client=%s error=%s", self.client, exc)
            self.send_400_response(NOT_HTTP)

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn warns (two lines) for every request with an Upgrade header it does not
        # serve, and none is served here (no WebSocket): any client could fill the log.
        log.debug("event=gateway.upgrade_ignored client=%s", self.client)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answers text/plain; its message is not the client's business.
        self._refuse(400, NOT_HTTP)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        super().on_header(name, value)
        self._header_bytes_parsed = getattr(self, "_header_bytes_parsed", 0) + len(name) + len(value) + 4
        if self._header_bytes_parsed + len(self.url) > MAX_HEADER_BYTES:
            self._refuse(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._header_bytes_parsed = 0
        if self._refused:
            return  # the connection is closing: never start the application
        self._disarm()
        if not self.url.startswith(b"/") and not self._absolute_form():
            return
        super().on_headers_complete()

    def _absolute_form(self) -> bool:
        """A request target that is not a path.  RFC 9112 3.2.2: a server must accept the
        absolute-form (``GET http://host/path``), and must ignore the Host header for the
        host the target names; so the target's authority replaces the Host header here,
        and the Guard checks that.  Authority-form, asterisk-form, another scheme, or user
        information in the authority (``http://127.0.0.1:80@evil/``) are refused: 400."""
        m = _ABSOLUTE_FORM.fullmatch(self.url)
        if m is None:
            self._refuse(400, "the request target must be a path, or an http URL with no "
                              "user information")
            return False
        self.headers[:] = [(k, v) for k, v in self.headers if k != b"host"]  # scope's list
        self.headers.append((b"host", m.group(1)))
        return True

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()
            # The next bytes on a kept-alive connection are the next request's head:
            # count them from its first read (its header timer starts at its first byte).
            self._in_headers = True
            self._header_bytes = 0
            self._tail = b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(header_timeout: float) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn (``Config(http=...)``) with this header timeout."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"header_timeout": header_timeout})


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
    * The fast paths answer the window read, the model list, a valid admission and a
      valid chat completion without the framework's routing and dependency layers (the
      same code as their routes).
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

    @staticmethod
    async def _answer(send: Send, status: int, body: Callable[[], Awaitable[bytes]]) -> None:
        """Send ``status`` and the JSON ``body()`` returns, or the standard error object
        of the ApiError it raises (as the app's exception handlers would: any other
        exception is a 500 with a fixed message, its text in the log only)."""
        headers: dict[str, str] = {}
        try:
            out = await body()
        except ApiError as exc:
            status, out, headers = exc.status, dumps(exc.body()), exc.headers
        except Exception:
            log.exception("event=gateway.error")
            status, out = 500, dumps(error_body(500, INTERNAL))
        await send_json(send, status, out, headers)

    async def _window_fast_path(self, scope: Scope, send: Send) -> None:
        """GET /aotx/v1/requests/{id}: the hottest read, without the framework's layers."""
        g = self.gateway()

        async def window() -> bytes:
            principal = await g.authenticate(Request(scope))
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"),
                             keep_blank_values=True)
            cursor = query.get("cursor", [None])[-1]
            return await calls.window_body(g, principal,
                                           scope["path"][len("/aotx/v1/requests/"):], cursor)

        await self._answer(send, 200, window)

    async def _models_fast_path(self, scope: Scope, send: Send) -> None:
        """GET /v1/models, which clients and load balancers poll, without the framework's
        layers (they cost more than the answer does)."""
        g = self.gateway()

        async def models() -> bytes:
            return await routes_openai.models_body(g, await g.authenticate(Request(scope)))

        await self._answer(send, 200, models)

    @staticmethod
    def _valid_chat(body: dict[str, Any]) -> ChatRequest | None:
        """The body as the route would validate it, when it does; else None (the route
        answers it exactly as before: its credentials are checked first)."""
        try:
            return ChatRequest.model_validate(body)
        except ValidationError:
            return None

    async def _submit_fast_path(self, scope: Scope, body: dict[str, Any], send: Send) -> bool:
        """POST /aotx/v1/requests without the framework's layers (they cost ~40 % of the
        gateway's CPU for an admission), for a body that validates."""
        if (chat := self._valid_chat(body)) is None:
            return False
        g = self.gateway()

        async def admit() -> bytes:
            return await calls.admission_body(g, chat, await g.authenticate(Request(scope)))

        await self._answer(send, 202, admit)
        return True

    async def _chat_fast_path(self, scope: Scope, body: dict[str, Any], receive: Receive,
                              send: Send) -> bool:
        """POST /v1/chat/completions without the framework's layers, for a body that
        validates: the route's own code (``choices.completion``), its answer or stream
        sent as the route's would be, an ApiError as the app's handler answers it."""
        if (chat := self._valid_chat(body)) is None:
            return False
        g = self.gateway()
        try:
            response = await choices.completion(g, chat, await g.authenticate(Request(scope)))
        except ApiError as exc:
            response = error_response(exc)
        except Exception:
            log.exception("event=gateway.error")
            response = json_response(error_body(500, INTERNAL), 500)
        await response(scope, receive, send)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (refused := target_refusal(scope)
                or host_refusal(scope, self.loopback_only)) is not None:
            await self._refuse(send, *refused)
            return
        streamed = (scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS")
                    or scope["path"] == "/aotx/v1/media")
        has_body = any(k == b"transfer-encoding" or (k == b"content-length" and v.strip(b" 0"))
                       for k, v in scope["headers"])
        if scope["method"] == "GET" and not has_body and _WINDOW_PATH.match(scope["path"]):
            await self._window_fast_path(scope, send)
        elif scope["method"] == "GET" and not has_body and scope["path"] == "/v1/models":
            await self._models_fast_path(scope, send)
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
            if not typed_json(scope):
                scope = as_json(scope)  # FastAPI's route (the fast paths want the type)
            elif (scope["path"] == "/aotx/v1/requests" and await self._submit_fast_path(
                    scope, obj, send)
                    or scope["path"] == "/v1/chat/completions" and await self._chat_fast_path(
                        scope, obj, receive, send)):
                return
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


