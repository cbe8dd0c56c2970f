"""What a hostile principal tried in issue 39, end to end on the real service: ids that
cannot exist, numbers too long to convert, a replacement grant, an embedding flood and
schemas that cannot be matched.  Each test fails on 4299a01 for its finding's reason."""

from __future__ import annotations

import pytest

from ..helpers import Service
from .test_e2e_foundation import poll_until_terminal
from .test_e2e_grants import aotx_cli, client, mint, submit

pytestmark = pytest.mark.e2e

HIGH = "resp_" + "f" * 48  # epoch 2^64 - 1: no SQLite integer holds it as it is


def test_a_response_id_no_epoch_can_have_is_unknown_on_every_route(service: Service) -> None:
    """Before: 500 (OverflowError in the response store), and the connection closed
    without saying so, so the pooled client's next request failed."""
    with service.client() as c:  # one pooled connection for every request
        for method, path, body in (
                ("GET", f"/v1/responses/{HIGH}", None),
                ("GET", f"/v1/responses/{HIGH}/input_items", None),
                ("POST", f"/v1/responses/{HIGH}/cancel", None),
                ("DELETE", f"/v1/responses/{HIGH}", None),
                ("POST", "/v1/responses", {"model": "smollm2", "input": "hi",
                                           "previous_response_id": HIGH,
                                           "max_output_tokens": 4})):
            r = c.request(method, path, json=body)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["type"] == "not_found_error"
            assert c.get("/v1/models").status_code == 200  # the connection is still good


def test_a_token_id_too_long_to_convert_is_the_apis_own_400(service: Service) -> None:
    """Before: the 400's message was Python's ("Exceeds the limit (4300 digits) ...")."""
    with service.client() as c:
        for key in ("9" * 5000, "9" * 11, "-1", "１２"):
            r = c.post("/v1/chat/completions", json={
                "model": "smollm2", "max_tokens": 1, "logit_bias": {key: 1},
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "logit_bias" and "token ids" in err["message"]
            assert "digits" not in err["message"] and "sys." not in err["message"]
        r = c.post("/v1/completions", json={"model": "smollm2", "prompt": "hi",
                                             "max_tokens": 1, "logit_bias": {"9" * 5000: 1}})
        assert r.status_code == 400 and "sys." not in r.text


def test_a_second_token_keeps_the_grant_and_another_definition_replaces_it(
        service: Service) -> None:
    """docs/security.md's rule: the same flags add a token and hide nothing; other flags
    replace the grant and hide what was admitted before, from every token."""
    first = mint(service, "carol", "--actions", "submit,read,cancel")
    with client(service, first) as c:
        rid = submit(c).json()["id"]
        poll_until_terminal(c, rid)
        resp = c.post("/v1/responses", json={"model": "smollm2", "input": "hi",
                                              "max_output_tokens": 2}).json()["id"]
    same = _mint_saying(service, "grant unchanged", "--actions", "submit,read,cancel")
    for token in (first, same):
        with client(service, token) as c:
            assert c.get(f"/aotx/v1/requests/{rid}").status_code == 200
            assert c.get(f"/v1/responses/{resp}").status_code == 200
            r = c.post("/v1/responses", json={"model": "smollm2", "input": "more",
                                              "previous_response_id": resp,
                                              "max_output_tokens": 2})
            assert r.status_code == 200, r.text
    other = _mint_saying(service, "grant replaced", "--actions", "submit,read,cancel,telemetry")
    for token in (first, same, other):
        with client(service, token) as c:
            assert c.get(f"/aotx/v1/requests/{rid}").status_code == 404
            assert c.get(f"/v1/responses/{resp}").status_code == 404
            r = c.post("/v1/responses", json={"model": "smollm2", "input": "more",
                                              "previous_response_id": resp,
                                              "max_output_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def _mint_saying(svc: Service, said: str, *args: str) -> str:
    """Another token for carol; ``aotx token create`` says what became of her grant."""
    r = aotx_cli(svc, "token", "create", "--principal", "carol", *args)
    assert r.returncode == 0 and said in r.stderr, r.stderr
    return r.stdout.strip().splitlines()[-1]
