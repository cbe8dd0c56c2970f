"""docs/scale-out.md's Envoy route table against aotx's ids: every follow-up of a device's
request or response is routed to that device's cluster, creations to the picker's pool,
and an id of no listed device is answered 404 by the router.  Envoy's rule is emulated:
the first route whose prefix starts the path (without its query) wins."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest

from aotx import ids
from aotx.gateway.responses import response_id

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "scale-out.md"


def routes() -> list[dict[str, Any]]:
    text = DOC.read_text()
    block = re.search(r"## Envoy's routes.*?```json\n(.*?)```", text, re.S)
    assert block is not None, "the route table is gone from docs/scale-out.md"
    table: list[dict[str, Any]] = json.loads(block.group(1))
    return table


def route(path: str) -> str:
    """The cluster, or ``"404"`` for a direct answer, of the first matching route."""
    path = path.split("?", 1)[0]
    for r in routes():
        if path.startswith(r["match"]["prefix"]):
            if "direct_response" in r:
                body = json.loads(r["direct_response"]["body"]["inline_string"])
                assert body["error"]["type"] == "not_found_error"
                return str(r["direct_response"]["status"])
            cluster: str = r["route"]["cluster"]
            return cluster
    raise AssertionError(f"no route for {path}")


@pytest.mark.parametrize("device", [1, 2])
@pytest.mark.parametrize("count", [1, 0x2a, (1 << 48) - 1])
def test_follow_ups_go_to_the_device_their_id_names(device: int, count: int) -> None:
    epoch, identity = ids.make_epoch(device, count), bytes(range(16))
    rid, resp = ids.format_request_id(epoch, identity), response_id(epoch, identity)
    for path in (f"/aotx/v1/requests/{rid}", f"/aotx/v1/requests/{rid}/events?cursor=4",
                 f"/aotx/v1/requests/{rid}/cancel", f"/aotx/v1/requests/{rid}/logprobs",
                 f"/v1/responses/{resp}", f"/v1/responses/{resp}/input_items"):
        assert route(path) == f"aotx-device-{device}", path


def test_ids_of_no_listed_device_are_answered_by_the_router() -> None:
    for device in (0, 3, ids.MAX_DEVICE_ID):
        epoch = ids.make_epoch(device, 1)
        assert route(f"/aotx/v1/requests/{ids.format_request_id(epoch, bytes(16))}") == "404"
        assert route(f"/v1/responses/{response_id(epoch, bytes(16))}") == "404"


def test_creations_and_shared_reads_go_to_the_pool_with_a_connect_retry_only() -> None:
    for path in ("/aotx/v1/requests", "/v1/chat/completions", "/v1/completions",
                 "/v1/responses", "/v1/embeddings", "/v1/models", "/aotx/v1/capabilities"):
        assert route(path) == "aotx-pool", path
    pool = routes()[-1]["route"]
    assert set(pool["retry_policy"]["retry_on"].split(",")) == {"reset-before-request",
                                                               "connect-failure"}
    pinned = [r for r in routes() if r.get("route", {}).get("cluster", "").startswith(
        "aotx-device-")]
    assert pinned and all("retry_policy" not in r["route"] for r in pinned)
