"""A local HTTP server posing as the Hugging Face hub (through ``HF_ENDPOINT``): the two
routes ``huggingface_hub`` uses to list a repository and fetch a file, with ``Range``.

``stall``: a file name whose first whole-file GET sends half the bytes and then holds the
connection until :attr:`FakeHub.release` is set (a transfer to interrupt).  Every GET's
``Range`` start is recorded in :attr:`FakeHub.ranges`.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

COMMIT = "c0ffee" * 6 + "c0ff"  # 40 hex digits


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.stall = ""
        self.halfway = threading.Event()  # the stalled transfer sent its half
        self.release = threading.Event()
        self.ranges: list[tuple[str, int]] = []  # (file, first byte asked) of each GET
        self.tokens: set[str] = set()  # the Authorization headers seen
        self.wrong_sha = False  # list every file with a SHA-256 it does not have
        self.url = ""

    def tree(self, repo: str) -> list[dict[str, object]]:
        return [{"type": "file", "path": name, "size": len(data),
                 "oid": hashlib.sha1(data).hexdigest(),
                 "lfs": {"oid": hashlib.sha256(data + b"x" * self.wrong_sha).hexdigest(),
                         "size": len(data),
                         "pointerSize": 134}}
                for name, data in sorted(self.repos[repo].items())]


def _handler(hub: FakeHub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _file(self) -> tuple[str, bytes] | None:
            hub.tokens.add(self.headers.get("Authorization", ""))
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", self.path.split("?")[0])
            if m and m[1] in hub.repos and m[2] in hub.repos[m[1]]:
                return m[2], hub.repos[m[1]][m[2]]
            m = re.fullmatch(r"/files/(.+)", self.path)
            for files in hub.repos.values():
                if m and m[1] in files:
                    return m[1], files[m[1]]
            return None

        def _head(self, name: str, data: bytes, start: int) -> None:
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", COMMIT)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()

        def do_HEAD(self) -> None:  # noqa: N802
            found = self._file()
            if found is None:
                self.send_error(404)
                return
            self._head(*found, 0)

        def do_GET(self) -> None:  # noqa: N802
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^?]+(\?.*)?", self.path)
            if m and m[1] in hub.repos:
                body = json.dumps(hub.tree(m[1])).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            found = self._file()
            if found is None:
                self.send_error(404)
                return
            name, data = found
            asked = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            start = int(asked[1]) if asked else 0
            hub.ranges.append((name, start))
            self._head(name, data, start)
            if name == hub.stall and start == 0:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                hub.halfway.set()
                hub.release.wait(120)
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def serving(repos: dict[str, dict[str, bytes]]) -> Iterator[FakeHub]:
    hub = FakeHub(repos)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
