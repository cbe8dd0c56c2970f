"""Ollama's ``keep_alive`` on the request routes (gateway/body.py): its forms, and the
SUBMIT flag and header field each route sends it in (device/ondemand.py reads them)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from aotx import wire
from aotx.gateway.body import _keep_alive
from aotx.gateway.completions import CompletionRequest, submission
from aotx.gateway.credentials import PrincipalGrant
from aotx.gateway.responses import ResponseRequest
from aotx.gateway.service import Principal

from .test_gateway_http import BODY, ScriptedBroker, error, gw, state

__all__ = ["gw"]  # (the fixture)


@pytest.mark.parametrize(("given", "ms"), [
    (300, 300_000), (0, 0), (2.5, 2_500), (-1, -1), (-3600, -1), ("10m", 600_000),
    ("1h30m", 5_400_000), ("500ms", 500), ("45s", 45_000), ("-1", -1), ("-5m", -1),
    ("12", 12_000), (None, None)])
def test_the_forms_ollama_takes(given: Any, ms: int | None) -> None:
    assert _keep_alive(given) == ms


@pytest.mark.parametrize("given", ["soon", "5 m", "1d", "", "m", True, [1], {"s": 1},
                                   366 * 86400, "9000h"])
def test_anything_else_is_refused(given: Any) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        _keep_alive(given)


def test_the_native_route_sends_it_in_the_submit_header(gw: Any) -> None:
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        broker.script[wire.Op.SUBMIT] = lambda h, p: (state(h, 202, wire.Phase.QUEUED), b"")
        for given, flag, ms in (("5m", True, 300_000), (-1, True, wire.KEEP_ALIVE_FOREVER),
                                (0, True, 0), (None, False, 0)):
            body = {**BODY, **({"keep_alive": given} if given is not None else {})}
            r = await c.post("/aotx/v1/requests", content=json.dumps(body))
            assert r.status_code == 202, r.text
            h = [s for s in broker.sent if s.op == wire.Op.SUBMIT][-1]
            assert bool(h.submit_flags & wire.SUBMIT_FLAG_KEEP_ALIVE) is flag
            assert h.keep_alive_ms == ms
        sent = len(broker.sent)
        r = await c.post("/v1/chat/completions", content=json.dumps({**BODY, "keep_alive": "x"}))
        assert (r.status_code, error(r)["param"]) == (400, "keep_alive")
        assert not any(h.op == wire.Op.SUBMIT for h in broker.sent[sent:])

    gw(test)


def test_completions_and_responses_carry_it() -> None:
    model = wire.ModelInfo(1, "smollm2", bytes(32), wire.MOD_TEXT, 0, 2048)
    who = Principal(7, "p", PrincipalGrant(7, "p", int(wire.Action.all()), ("*",)))
    body = CompletionRequest.model_validate({"model": "smollm2", "prompt": "hi",
                                             "keep_alive": "1h"})
    h, _, _ = submission(body, "hi", 0, model, who)
    assert h.submit_flags & wire.SUBMIT_FLAG_KEEP_ALIVE and h.keep_alive_ms == 3_600_000
    plain, _, _ = submission(CompletionRequest.model_validate(
        {"model": "smollm2", "prompt": "hi"}), "hi", 0, model, who)
    assert not plain.submit_flags & wire.SUBMIT_FLAG_KEEP_ALIVE and plain.keep_alive_ms == 0
    resp = ResponseRequest.model_validate({"model": "smollm2", "input": "hi", "keep_alive": 0})
    assert resp.chat([]).keep_alive == 0  # (milliseconds, not read as seconds again)
    assert ResponseRequest.model_validate(
        {"model": "smollm2", "input": "hi", "keep_alive": "2s"}).chat([]).keep_alive == 2000
