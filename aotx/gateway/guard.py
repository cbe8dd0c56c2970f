"""Connection-level limits that uvicorn alone does not give.

* **Header read timeout** (slow-loris): the request line and headers must
  arrive within ``HEADER_TIMEOUT`` seconds of the connection opening (or of the
  first byte of the next request on a kept-alive connection), else 408 and close.
* **Header size**: more than ``MAX_HEADER_BYTES`` before the end of the headers
  answers 431 and closes.

Body pacing (each body chunk within ``BODY_IDLE_TIMEOUT``) is enforced by the
ASGI body middleware in :mod:`aotx.gateway`.  The protocol class is handed to
uvicorn as ``Config(http=GuardedHttpToolsProtocol)``.
"""

from __future__ import annotations

import asyncio
import logging
import os

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_body

log = logging.getLogger("aotx.gateway.http")

HEADER_TIMEOUT = float(os.environ.get("AOTX_HEADER_TIMEOUT", "10"))
MAX_HEADER_BYTES = 16 * 1024
BODY_IDLE_TIMEOUT = float(os.environ.get("AOTX_BODY_TIMEOUT", "30"))

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
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
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT, self._headers_too_slow)

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
        body = orjson.dumps(error_body(status, message))
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n"
                             % (status, _REASONS[status], len(body)) + body)
        self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            log.info("event=gateway.header_timeout client=%s", self.client)
            self._refuse(408, f"request headers not received within {HEADER_TIMEOUT:.0f} s")

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
        super().data_received(data)

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
        super().on_headers_complete()

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
