"""gateway/connection.py subclasses uvicorn's HttpToolsProtocol, which uvicorn does not
document as public: this fails when the installed uvicorn is not the version pinned in
pyproject.toml, or when the class no longer has what the subclass overrides, calls and
reads (connection.py's docstring lists them)."""

from __future__ import annotations

import inspect
import pathlib
import re

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aotx.gateway.connection import GuardedHttpToolsProtocol

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERRIDES = ("connection_made", "data_received", "on_message_begin", "on_header",
             "on_headers_complete", "on_body", "on_message_complete", "connection_lost",
             "send_400_response", "_unsupported_upgrade_warning")
CALLS = ("_unset_keepalive_if_required", "_should_upgrade", "handle_websocket_upgrade")
READS = ("parser", "transport", "url", "headers", "client", "loop")


def test_uvicorn_is_the_pinned_version() -> None:
    pinned = re.search(r'"uvicorn\[standard\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned, "pyproject.toml must pin uvicorn exactly"
    assert uvicorn.__version__ == pinned.group(1)


def test_the_protocol_class_still_has_what_the_guard_uses() -> None:
    for name in OVERRIDES + CALLS:
        assert callable(getattr(HttpToolsProtocol, name, None)), name
    for name in OVERRIDES:  # overridden with the same parameters
        ours = inspect.signature(getattr(GuardedHttpToolsProtocol, name)).parameters
        theirs = inspect.signature(getattr(HttpToolsProtocol, name)).parameters
        assert list(ours) == list(theirs), name
    source = inspect.getsource(HttpToolsProtocol)
    for name in READS:
        assert re.search(rf"self\.{name}\b(: [^=\n]+)? = ", source), name
