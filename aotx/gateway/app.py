"""The gateway's ASGI application: the factory that puts the routers, the exception
handlers, the console and the connection guard together, and the process's ``run``.

Routers by surface: ``routes_openai`` (standard ``/v1``), ``routes_completions`` (the
legacy ``/v1/completions``), ``routes_responses`` (``/v1/responses``), ``routes_native`` (requests, capabilities, telemetry),
``routes_media``, ``routes_policy`` (policy and memory), ``routes_models`` (models'
residency, load and unload), ``routes_tokens`` (token counts and the tokenizer), ``routes_messages``
(Anthropic's Messages API), ``routes_rerank`` (``/v1/rerank``), ``routes_ops`` (health, readiness, metrics).  The :class:`~aotx.gateway.service.Gateway`
lives on ``app.state.gateway``; routes reach it and the caller through dependencies.
Every error becomes the standard error object here, in the handlers, or in-band once a
stream has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from ..config import Settings
from ..cpuslice import request_short_slice
from ..paths import RuntimePaths
from . import anthropic as A
from . import (
    routes_completions,
    routes_embeddings,
    routes_media,
    routes_messages,
    routes_models,
    routes_native,
    routes_openai,
    routes_ops,
    routes_policy,
    routes_rerank,
    routes_responses,
    routes_tokens,
)
from . import schemas as S
from .broker_client import BrokerClient
from .connection import guarded_protocol
from .credentials import ensure_admin_token
from .errors import ApiError, error_body
from .guard import Guard
from .render import failure_response, invalid_body, json_response
from .response_store import ResponseStore
from .service import Gateway

log = logging.getLogger("aotx.gateway")

_PUBLIC = ("/healthz", "/readyz", "/openapi.json", "/docs", "/redoc")


def create_app(paths: RuntimePaths, settings: Settings | None = None, loopback_only: bool = True,
               broker: BrokerClient | None = None) -> ASGIApp:
    """The whole application, behind its guard.  ``broker`` replaces the socket client
    (in-process tests give a scripted one)."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        g = Gateway(paths, settings, broker)
        app.state.gateway = g
        app.state.responses = ResponseStore(paths.state_dir)
        task = asyncio.get_running_loop().create_task(g.poll_loop())
        yield
        task.cancel()
        await g.broker.close()
        g.store.close()
        app.state.responses.close()

    # No slash redirects (here and on every router): Starlette answers a path with an
    # extra or missing "/" with a 307 before any route runs, so before authentication,
    # with a Location built from the client's Host header.  Such a path is a 404.
    app = FastAPI(title="aotx", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="Local LLM inference: standard OpenAI routes and the native "
                              "aotx API.")
    _handle_errors(app)
    routes: list[BaseRoute] = []
    for module in (routes_ops, routes_native, routes_media, routes_policy, routes_models,
                   routes_openai, routes_completions, routes_embeddings, routes_responses,
                   routes_tokens, routes_messages, routes_rerank):
        _document_errors(module.router.routes)
        app.include_router(module.router)
        routes += module.router.routes
    # The web console: static files shipped in the package (no CDN). They hold no secret;
    # every API call the page makes carries the token the user typed.
    app.mount("/console", StaticFiles(directory=os.path.join(os.path.dirname(__file__),
                                                             "console"), html=True),
              name="console")
    json_paths = frozenset(r.path for r in routes if isinstance(r, APIRoute)
                           and r.body_field is not None and "POST" in (r.methods or ()))
    return Guard(app, loopback_only, lambda: app.state.gateway, settings.max_body,
                 settings.body_timeout, json_paths)


def _handle_errors(app: FastAPI) -> None:
    # The same answers as the guard's routes give (render.failure_response).
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return failure_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        field = getattr(request.scope.get("route"), "body_field", None)
        return failure_response(invalid_body(field.field_info.annotation if field else None,
                                             exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # (Starlette re-raises it after this answer, and uvicorn logs the traceback.)
        return failure_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return json_response(error_body(exc.status_code, str(exc.detail)), exc.status_code,
                             getattr(exc, "headers", None))


def _document_errors(routes: list[BaseRoute]) -> None:
    """Declare the standard error responses on every route of the OpenAPI document."""
    for route in routes:
        if not isinstance(route, APIRoute) or route.path in _PUBLIC:
            continue
        anthropic = route.path in A.PATHS  # (its errors in Anthropic's envelope)
        for status in S.COMMON_ERRORS:
            route.responses.setdefault(status, {
                "model": S.AnthropicErrorResponse if anthropic else S.ErrorResponse,
                "description": "Anthropic's error envelope" if anthropic
                else "standard error object"})
        methods = route.methods or set()
        if "POST" in methods:
            route.responses.setdefault(200, {"description": "OK"})
            route.responses.setdefault(201, {"description": "Created"})
            route.responses.setdefault(202, {"description": "Accepted"})
        if "DELETE" in methods:
            route.responses.setdefault(204, {"description": "Removed"})


def run(paths: RuntimePaths, host: str, port: int, settings: Settings) -> None:
    paths.ensure()
    ensure_admin_token(paths.admin_token)
    loopback = host in ("127.0.0.1", "localhost", "::1")
    app = create_app(paths, settings, loopback_only=loopback)
    if not loopback:
        log.warning("event=gateway.public_bind host=%s: the gateway is reachable from other "
                    "machines; every route still needs a bearer token", host)
    log.info("event=gateway.listening url=http://%s:%d", host, port)
    url_host = f"[{host}]" if ":" in host else host
    with open(os.path.join(paths.run_dir, "gateway.url"), "w") as f:
        f.write(f"http://{url_host}:{port}\n")
    request_short_slice(settings.short_slice)
    uvicorn.Server(server_config(app, host, port, settings)).run()


def server_config(app: ASGIApp, host: str, port: int, settings: Settings,
                  loop: str = "uvloop") -> uvicorn.Config:
    """uvicorn's configuration for the gateway (tests serve the app with it too)."""
    # ws="none": no route speaks WebSocket, and a handshake handed to uvicorn's WebSocket
    # protocol would skip the Guard (it passes non-HTTP scopes through) and answer a bare
    # text 403; with none, an Upgrade header is ignored and the request is plain HTTP.
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          loop=loop, http=guarded_protocol(settings.header_timeout),
                          ws="none", timeout_graceful_shutdown=3, server_header=False)
