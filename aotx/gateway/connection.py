"""The connection guard: the limits on HTTP connections that uvicorn alone does not give.

* **Header read timeout** (slow-loris): the request line and headers must
  arrive within ``header_timeout`` seconds of the connection opening (or of the
  first byte of the next request on a kept-alive connection), else 408 and close.
* **Header size**: more than ``MAX_HEADER_BYTES`` before the end of the headers
  answers 431 and closes.
* **Malformed requests**: bytes the HTTP parser refuses answer 400 with the standard
  error object (not uvicorn's text) and close.
* **Request targets**: a path, or an absolute ``http://host/path`` whose authority then
  stands for the Host header (RFC 9112 3.2.2); anything else answers 400.

These live below ASGI, in the bytes as they arrive, so :class:`GuardedHttpToolsProtocol`
subclasses uvicorn's ``HttpToolsProtocol``, a class uvicorn does not document as public:
no ASGI middleware sees a request before its headers are complete, which is what a
slow-loris client never lets happen, and uvicorn has no setting for a header timeout or
the error body of a malformed request.  It overrides ``connection_made``,
``data_received``, ``on_message_begin``, ``on_header``, ``on_headers_complete``,
``on_body``, ``on_message_complete``, ``connection_lost``, ``send_400_response`` and
``_unsupported_upgrade_warning``; calls ``_unset_keepalive_if_required``,
``_should_upgrade`` and ``handle_websocket_upgrade``; and reads ``self.parser``,
``self.transport``, ``self.url``, ``self.headers``, ``self.client`` and ``self.loop``.  So uvicorn
is pinned to one version in pyproject.toml, and ``tests/unit/test_connection.py`` fails
when the installed uvicorn is another or its class no longer has those members.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_body
from .render import dumps

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
