"""A typed Python client for the native aotx API (sync and async, on httpx).

It does what the seed asks every client to do, once and correctly: keep byte
cursors, follow ``next_cursor`` until ``total_bytes``, resume an event stream
with ``Last-Event-ID`` after a dropped connection or a gateway restart, and
decode UTF-8 incrementally (a part can end inside a character)::

    from aotx.client import Client

    with Client("http://127.0.0.1:8000", token) as c:
        adm = c.submit([{"role": "user", "content": "Hello"}], max_tokens=32)
        for text in c.text(adm.id):
            print(text, end="", flush=True)
        print(c.wait(adm.id).finish_reason)

Errors are exceptions carrying the HTTP status and the standard error object:
:class:`NotFound` (404), :class:`Gone` (410, an ended runtime epoch),
:class:`Conflict` (409), :class:`Unauthorized`, :class:`Forbidden`,
:class:`RateLimited`, :class:`BadRequest`, all subclasses of :class:`AotxError`.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

TERMINAL = ("completed", "failed", "cancelled")


class AotxError(Exception):
    status = 0

    def __init__(self, status: int, error: dict[str, Any],
                 retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {error.get('message', '')}")
        self.status = status
        self.error = error
        self.retry_after = retry_after  # seconds, from Retry-After (429, 503)

    @property
    def message(self) -> str:
        return str(self.error.get("message", ""))


class BadRequest(AotxError):
    pass


class Unauthorized(AotxError):
    pass


class Forbidden(AotxError):
    pass


class NotFound(AotxError):
    pass


class Conflict(AotxError):
    pass


class Gone(AotxError):
    pass


class RateLimited(AotxError):
    pass


class Unavailable(AotxError):
    pass


_BY_STATUS: dict[int, type[AotxError]] = {400: BadRequest, 401: Unauthorized, 403: Forbidden,
                                          404: NotFound, 409: Conflict, 410: Gone,
                                          413: BadRequest, 429: RateLimited, 503: Unavailable}


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": r.text[:500], "type": "unknown", "code": None, "param": None}
    try:
        retry_after: float | None = float(r.headers["retry-after"])
    except (KeyError, ValueError):
        retry_after = None
    raise _BY_STATUS.get(r.status_code, AotxError)(r.status_code, error, retry_after)


@dataclass(frozen=True)
class Admission:
    id: str
    runtime_epoch: int
    state: str
    media: list[dict[str, str]]  # {"id": "src-...", "digest": "sha256:..."} per leased source


@dataclass(frozen=True)
class RequestState:
    id: str
    runtime_epoch: int
    model: str | None
    model_role: int
    state: str
    cancel_requested: bool
    finish_reason: str | None
    failure: dict[str, Any] | None
    usage: dict[str, int]

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestState:
        return cls(d["id"], int(d["runtime_epoch"]), d.get("model"), int(d["model_role"]),
                   d["state"], bool(d["cancel_requested"]), d.get("finish_reason"),
                   d.get("failure"), dict(d["usage"]))


@dataclass(frozen=True)
class Window:
    data: bytes
    cursor: int
    next_cursor: int
    total_bytes: int


@dataclass(frozen=True)
class Emission:
    offset: int
    next_cursor: int
    data: bytes


@dataclass
class _SSE:
    """Incremental server-sent-events parser (sans I/O)."""

    event: dict[str, str] = field(default_factory=dict)

    def feed(self, line: str) -> dict[str, str] | None:
        if line.startswith(":"):
            return None
        if line:
            k, _, v = line.partition(":")
            self.event[k] = v[1:] if v.startswith(" ") else v
            return None
        ev, self.event = self.event, {}
        return ev or None


class _Text:
    """Output bytes as text, decoded incrementally: an emission can end inside a
    character, and output read from a byte cursor can begin inside one.  Those first
    bytes (at most three continuation bytes) belong to a character before the cursor,
    so the text starts at the first whole character at or after it."""

    def __init__(self, cursor: int) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.skip = 3 if cursor > 0 else 0

    def feed(self, data: bytes) -> str:
        while self.skip and data:
            if not 0x80 <= data[0] < 0xC0:
                self.skip = 0
                break
            data, self.skip = data[1:], self.skip - 1
        return self.decoder.decode(data)

    def end(self) -> str:
        return self.decoder.decode(b"", final=True)


def _to_item(ev: dict[str, str]) -> Emission | RequestState | AotxError:
    kind = ev.get("event")
    data = json.loads(ev.get("data", "{}"))
    if kind == "emission":
        return Emission(int(data["offset"]), int(data["next_cursor"]),
                        base64.b64decode(data["bytes"]))
    if kind == "error":
        err = data.get("error", data)
        return AotxError(0, err)
    return RequestState.from_json(data)


def _body(messages: list[dict[str, Any]], model: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "messages": messages, **params}


# Reconnect policy for followed streams: a dropped connection, a gateway that
# restarts (connection refused, 503) are retried with backoff up to this long.
RECONNECT_SECONDS = 60.0
RECONNECT_PAUSE = 0.2


def _page(limit: int, cursor: str | None) -> dict[str, Any]:
    """The query of one page of the media list."""
    return {"limit": limit, **({"cursor": cursor} if cursor else {})}


def _control(action: str, expected_revision: int | str) -> dict[str, str]:
    return {"action": action, "expected_revision": str(expected_revision)}


class _Resume:
    """Where a followed stream is, and whether a failure is worth a reconnect (sans I/O)."""

    def __init__(self, request_id: str, cursor: int) -> None:
        self.request_id = request_id
        self.cursor = cursor
        self.deadline: float | None = None

    @property
    def path(self) -> str:
        return f"/aotx/v1/requests/{self.request_id}/events"

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": f"{self.request_id}:{self.cursor}"}

    def connected(self) -> None:
        self.deadline = None

    def item(self, ev: dict[str, str]) -> Emission | RequestState:
        """The parsed event; an SSE error event is raised as AotxError(0, ...)."""
        item = _to_item(ev)
        if isinstance(item, AotxError):
            raise item
        if isinstance(item, Emission):
            self.cursor = item.next_cursor
        return item

    def retry(self, exc: Exception, reconnect: bool) -> bool:
        """True to reconnect after ``exc``; False to let it propagate."""
        if isinstance(exc, AotxError) and not isinstance(exc, Unavailable) and exc.status:
            return False  # a real answer (401, 404, 410, ...): never retried
        if not reconnect:
            return False
        self.deadline = self.deadline or time.monotonic() + RECONNECT_SECONDS
        return time.monotonic() <= self.deadline


class Client:
    """Synchronous client."""

    def __init__(self, base_url: str, token: str, timeout: float = 120.0,
                 model: str = "smollm2") -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"})
        self.model = model

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        _raise_for(r)
        return r.json() if r.content else None

    # -- requests ------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return dict(self._json("GET", "/aotx/v1/capabilities"))

    def submit(self, messages: list[dict[str, Any]], model: str | None = None,
               **params: Any) -> Admission:
        d = self._json("POST", "/aotx/v1/requests", json=_body(messages, model or self.model,
                                                               params))
        return Admission(d["id"], int(d["runtime_epoch"]), d["state"], list(d["media"]))

    def get(self, request_id: str, cursor: int = 0) -> tuple[RequestState, Window]:
        d = self._json("GET", f"/aotx/v1/requests/{request_id}", params={"cursor": str(cursor)})
        o = d["output"]
        return RequestState.from_json(d), Window(base64.b64decode(o["bytes"]), int(o["cursor"]),
                                                 int(o["next_cursor"]), int(o["total_bytes"]))

    def read_all(self, request_id: str, cursor: int = 0) -> bytes:
        """Every byte from ``cursor`` on, following ``next_cursor`` to ``total_bytes``."""
        out = bytearray()
        while True:
            _, w = self.get(request_id, cursor)
            out += w.data
            cursor = w.next_cursor
            if cursor >= w.total_bytes:
                return bytes(out)

    def wait(self, request_id: str, poll: float = 0.05) -> RequestState:
        while True:
            state, _ = self.get(request_id)
            if state.terminal:
                return state
            time.sleep(poll)

    def cancel(self, request_id: str) -> RequestState:
        return RequestState.from_json(self._json("POST", f"/aotx/v1/requests/{request_id}/cancel"))

    def events(self, request_id: str, cursor: int = 0,
               reconnect: bool = True) -> Iterator[Emission | RequestState]:
        """Emissions and status events until the terminal status; resumes exactly."""
        at = _Resume(request_id, cursor)
        while True:
            try:
                with self.http.stream("GET", at.path, headers=at.headers()) as r:
                    if r.status_code >= 400:
                        r.read()
                        _raise_for(r)
                    at.connected()
                    parser = _SSE()
                    for line in r.iter_lines():
                        ev = parser.feed(line)
                        if ev is None:
                            continue
                        item = at.item(ev)
                        yield item
                        if isinstance(item, RequestState) and item.terminal:
                            return
            except (httpx.TransportError, AotxError) as exc:
                if not at.retry(exc, reconnect):
                    raise
                time.sleep(RECONNECT_PAUSE)

    def text(self, request_id: str, cursor: int = 0) -> Iterator[str]:
        """The output as text from ``cursor``, decoded incrementally (safe across split
        characters; from the first whole character at or after the cursor)."""
        dec = _Text(cursor)
        for item in self.events(request_id, cursor):
            if isinstance(item, Emission) and (t := dec.feed(item.data)):
                yield t
        if tail := dec.end():
            yield tail

    # -- media -----------------------------------------------------------------------
    def upload_media(self, data: bytes, content_type: str) -> dict[str, Any]:
        return dict(self._json("POST", "/aotx/v1/media", content=data,
                               headers={"Content-Type": content_type}))

    def list_media(self, limit: int = 100) -> Iterator[dict[str, Any]]:
        cursor: str | None = None
        while True:
            page = self._json("GET", "/aotx/v1/media", params=_page(limit, cursor))
            yield from page["data"]
            cursor = page["next_cursor"]
            if not cursor:
                return

    def get_media(self, source_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/aotx/v1/media/{source_id}"))

    def remove_media(self, source_id: str) -> None:
        self._json("DELETE", f"/aotx/v1/media/{source_id}")

    # -- telemetry and policy ----------------------------------------------------------
    def telemetry(self) -> dict[str, Any]:
        return dict(self._json("GET", "/aotx/v1/telemetry"))

    def policy(self) -> dict[str, Any]:
        return dict(self._json("GET", "/aotx/v1/policy"))

    def control_policy(self, action: str, expected_revision: int | str) -> dict[str, Any]:
        return dict(self._json("POST", "/aotx/v1/policy",
                               json=_control(action, expected_revision)))


class AsyncClient:
    """Asynchronous client: the same operations, awaited."""

    def __init__(self, base_url: str, token: str, timeout: float = 120.0,
                 model: str = "smollm2") -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                      headers={"Authorization": f"Bearer {token}"})
        self.model = model

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = await self.http.request(method, path, **kw)
        _raise_for(r)
        return r.json() if r.content else None

    async def capabilities(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/aotx/v1/capabilities"))

    async def submit(self, messages: list[dict[str, Any]], model: str | None = None,
                     **params: Any) -> Admission:
        d = await self._json("POST", "/aotx/v1/requests",
                             json=_body(messages, model or self.model, params))
        return Admission(d["id"], int(d["runtime_epoch"]), d["state"], list(d["media"]))

    async def get(self, request_id: str, cursor: int = 0) -> tuple[RequestState, Window]:
        d = await self._json("GET", f"/aotx/v1/requests/{request_id}",
                             params={"cursor": str(cursor)})
        o = d["output"]
        return RequestState.from_json(d), Window(base64.b64decode(o["bytes"]), int(o["cursor"]),
                                                 int(o["next_cursor"]), int(o["total_bytes"]))

    async def read_all(self, request_id: str, cursor: int = 0) -> bytes:
        out = bytearray()
        while True:
            _, w = await self.get(request_id, cursor)
            out += w.data
            cursor = w.next_cursor
            if cursor >= w.total_bytes:
                return bytes(out)

    async def wait(self, request_id: str, poll: float = 0.05) -> RequestState:
        while True:
            state, _ = await self.get(request_id)
            if state.terminal:
                return state
            await asyncio.sleep(poll)

    async def cancel(self, request_id: str) -> RequestState:
        return RequestState.from_json(
            await self._json("POST", f"/aotx/v1/requests/{request_id}/cancel"))

    async def events(self, request_id: str, cursor: int = 0,
                     reconnect: bool = True) -> AsyncIterator[Emission | RequestState]:
        at = _Resume(request_id, cursor)
        while True:
            try:
                async with self.http.stream("GET", at.path, headers=at.headers()) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        _raise_for(r)
                    at.connected()
                    parser = _SSE()
                    async for line in r.aiter_lines():
                        ev = parser.feed(line)
                        if ev is None:
                            continue
                        item = at.item(ev)
                        yield item
                        if isinstance(item, RequestState) and item.terminal:
                            return
            except (httpx.TransportError, AotxError) as exc:
                if not at.retry(exc, reconnect):
                    raise
                await asyncio.sleep(RECONNECT_PAUSE)

    async def text(self, request_id: str, cursor: int = 0) -> AsyncIterator[str]:
        dec = _Text(cursor)
        async for item in self.events(request_id, cursor):
            if isinstance(item, Emission) and (t := dec.feed(item.data)):
                yield t
        if tail := dec.end():
            yield tail

    # -- media -----------------------------------------------------------------------
    async def upload_media(self, data: bytes, content_type: str) -> dict[str, Any]:
        return dict(await self._json("POST", "/aotx/v1/media", content=data,
                                     headers={"Content-Type": content_type}))

    async def list_media(self, limit: int = 100) -> AsyncIterator[dict[str, Any]]:
        cursor: str | None = None
        while True:
            page = await self._json("GET", "/aotx/v1/media", params=_page(limit, cursor))
            for source in page["data"]:
                yield source
            cursor = page["next_cursor"]
            if not cursor:
                return

    async def get_media(self, source_id: str) -> dict[str, Any]:
        return dict(await self._json("GET", f"/aotx/v1/media/{source_id}"))

    async def remove_media(self, source_id: str) -> None:
        await self._json("DELETE", f"/aotx/v1/media/{source_id}")

    # -- telemetry and policy ----------------------------------------------------------
    async def telemetry(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/aotx/v1/telemetry"))

    async def policy(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/aotx/v1/policy"))

    async def control_policy(self, action: str, expected_revision: int | str) -> dict[str, Any]:
        return dict(await self._json("POST", "/aotx/v1/policy",
                                     json=_control(action, expected_revision)))
