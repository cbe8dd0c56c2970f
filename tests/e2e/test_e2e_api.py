"""The whole request surface, end to end on the real model (issue 3)."""

from __future__ import annotations

import base64
import codecs
import json
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ..helpers import Service
from .test_e2e_foundation import poll_until_terminal, read_all_windows

RUSSIAN = [{"role": "user", "content": "Write a sentence in Russian."}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]


def submit(c: httpx.Client, messages=None, **kw) -> str:
    body = {"model": "smollm2", "messages": messages or RUSSIAN, "temperature": 0,
            "max_tokens": 48, **kw}
    r = c.post("/aotx/v1/requests", json=body)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def sse(lines: Iterator[str]) -> Iterator[dict]:
    """Parse an SSE stream into {"event", "id", "data", "comment"} dicts."""
    ev: dict = {}
    for line in lines:
        if line == "":
            if ev:
                yield ev
            ev = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            k, _, v = line.partition(":")
            v = v[1:] if v.startswith(" ") else v
            ev[k if k != "event" else "event"] = v
    if ev:
        yield ev


def follow(c: httpx.Client, rid: str, params=None, headers=None) -> list[dict]:
    with c.stream("GET", f"/aotx/v1/requests/{rid}/events", params=params,
                  headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [e for e in sse(r.iter_lines()) if "comment" not in e]


def emissions(events: list[dict]) -> list[dict]:
    return [json.loads(e["data"]) | {"_id": e.get("id")} for e in events
            if e.get("event") == "emission"]


# -- native windows ------------------------------------------------------------

def test_windows_cursor_rules(service: Service) -> None:
    with service.client() as c:
        rid = submit(c)
        final = poll_until_terminal(c, rid)
        total = int(final["output"]["total_bytes"])
        full = read_all_windows(c, rid)
        assert len(full) == total
        r = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(total)})
        w = r.json()["output"]
        assert r.status_code == 200 and w["bytes"] == "" and w["next_cursor"] == str(total)
        mid = total // 2
        w = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(mid)}).json()["output"]
        assert base64.b64decode(w["bytes"]) == full[mid:]
        r = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(total + 1)})
        assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
        for bad in ("-1", "abc", "1.5", "", " 3", "0x10", str(2**64)):
            r = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": bad})
            assert r.status_code == 400, bad
            assert r.json()["error"]["param"] == "cursor"
        for field in ("id", "runtime_epoch", "model", "model_role", "state", "cancel_requested",
                      "finish_reason", "failure", "usage", "output"):
            assert field in final
        assert final["schema"] == "aotx.request.v1" and final["model"] == "smollm2"


def test_request_survives_client_disconnect_after_admission(service: Service) -> None:
    body = json.dumps({"model": "smollm2", "messages": RUSSIAN, "temperature": 0,
                       "max_tokens": 32}).encode()
    s = socket.create_connection(("127.0.0.1", service.port))
    s.sendall(b"POST /aotx/v1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Authorization: Bearer " + service.token.encode() + b"\r\n"
              b"Content-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    resp = b""
    while b"\r\n\r\n" not in resp or not resp.rstrip().endswith(b"}"):
        resp += s.recv(65536)
    s.close()  # the client goes away right after admission
    assert resp.startswith(b"HTTP/1.1 202")
    rid = json.loads(resp.split(b"\r\n\r\n", 1)[1])["id"]
    with service.client() as c:
        final = poll_until_terminal(c, rid)
    assert final["state"] == "completed" and final["usage"]["completion_tokens"] > 0


def test_status_rules_for_handles(service: Service) -> None:
    with service.client() as c:
        epoch = c.get("/aotx/v1/capabilities").json()["runtime_epoch"]
        unknown = f"req-{int(epoch):016x}-{'ab' * 16}"
        assert c.get(f"/aotx/v1/requests/{unknown}").status_code == 404
        assert c.post(f"/aotx/v1/requests/{unknown}/cancel").status_code == 404
        assert c.get(f"/aotx/v1/requests/{unknown}/events").status_code == 404
        for bad in ("nope", "req-1-2", unknown.upper(), unknown + "0"):
            r = c.get(f"/aotx/v1/requests/{bad}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        future = f"req-{int(epoch) + 5:016x}-{'ab' * 16}"
        assert c.get(f"/aotx/v1/requests/{future}").status_code == 404
        if int(epoch) > 1:
            past = f"req-{int(epoch) - 1:016x}-{'ab' * 16}"
            assert c.get(f"/aotx/v1/requests/{past}").status_code == 410


# -- events ----------------------------------------------------------------------

def test_events_reassemble_to_the_windows_and_end_with_one_terminal_status(service: Service) -> None:
    with service.client() as c:
        rid = submit(c)
        events = follow(c, rid)
        full = read_all_windows(c, rid)
    em = emissions(events)
    assert b"".join(base64.b64decode(e["bytes"]) for e in em) == full
    cursor = 0
    for e in em:
        assert e["schema"] == "aotx.emission.v1" and e["request_id"] == rid
        assert e["source_kind"] == "model" and e["encoding"] == "base64"
        assert e["offset"] == str(cursor)
        cursor += len(base64.b64decode(e["bytes"]))
        assert e["next_cursor"] == str(cursor) and e["_id"] == f"{rid}:{cursor}"
        assert isinstance(e["model_role"], int) and e["runtime_epoch"].isdigit()
    statuses = [json.loads(e["data"]) for e in events if e.get("event") == "status"]
    terminal = [s for s in statuses if s["state"] in ("completed", "failed", "cancelled")]
    assert len(terminal) == 1 and events[-1].get("event") == "status"
    assert json.loads(events[-1]["data"])["state"] == "completed"
    assert "output" not in terminal[0]
    assert not any(e.get("data") == "[DONE]" for e in events)


def test_events_resume_at_random_cursors_by_both_mechanisms(service: Service) -> None:
    with service.client() as c:
        rid = submit(c)
        poll_until_terminal(c, rid)
        full = read_all_windows(c, rid)
        rng = random.Random(5)
        cursors = {0, len(full)} | {rng.randrange(len(full)) for _ in range(4)}
        for cur in sorted(cursors):
            by_query = emissions(follow(c, rid, params={"cursor": str(cur)}))
            by_header = emissions(follow(c, rid, headers={"Last-Event-ID": f"{rid}:{cur}"}))
            for em in (by_query, by_header):
                assert b"".join(base64.b64decode(e["bytes"]) for e in em) == full[cur:]
                if em:
                    assert em[0]["offset"] == str(cur)
        r = c.get(f"/aotx/v1/requests/{rid}/events", params={"cursor": "0"},
                  headers={"Last-Event-ID": f"{rid}:0"})
        assert r.status_code == 400
        other = rid[:-1] + ("0" if rid[-1] != "0" else "1")
        for bad in (f"{other}:0", "garbage", f"{rid}:x", f"{rid}:-1", f"{rid}"):
            r = c.get(f"/aotx/v1/requests/{rid}/events", headers={"Last-Event-ID": bad})
            assert r.status_code == 400, bad
        r = c.get(f"/aotx/v1/requests/{rid}/events", params={"cursor": str(len(full) + 1)})
        assert r.status_code == 409


def test_resume_inside_a_utf8_sequence_reassembles_with_an_incremental_decoder(
        service: Service) -> None:
    with service.client() as c:
        rid = submit(c, max_tokens=40)
        poll_until_terminal(c, rid)
        full = read_all_windows(c, rid)
        text = full.decode("utf-8")
        assert any(ord(ch) > 127 for ch in text)
        k = next(i for i, b in enumerate(full) if b >= 0xC0) + 1  # inside a multi-byte char
        first = full[:k]  # what a client had when its connection dropped
        resumed = emissions(follow(c, rid, headers={"Last-Event-ID": f"{rid}:{k}"}))
    assert 0x80 <= base64.b64decode(resumed[0]["bytes"])[0] < 0xC0  # starts mid-sequence
    dec = codecs.getincrementaldecoder("utf-8")()
    out = dec.decode(first)
    for e in resumed:
        out += dec.decode(base64.b64decode(e["bytes"]))
    out += dec.decode(b"", final=True)
    assert out == text


def test_events_stream_live_and_first_bytes_arrive_before_completion(service: Service) -> None:
    with service.client() as c:
        rid = submit(c, messages=LONG, max_tokens=200)
        seen_running = False
        first_at = None
        with c.stream("GET", f"/aotx/v1/requests/{rid}/events") as r:
            for e in sse(r.iter_lines()):
                if e.get("event") == "emission" and first_at is None:
                    first_at = time.monotonic()
                    st = c.get(f"/aotx/v1/requests/{rid}").json()["state"]
                    seen_running = st in ("running", "preparing")
        assert first_at is not None and seen_running


def test_cancel_a_long_request(service: Service) -> None:
    with service.client() as c:
        rid = submit(c, messages=LONG, max_tokens=2000)
        while c.get(f"/aotx/v1/requests/{rid}").json()["state"] != "running":
            time.sleep(0.02)
        r = c.post(f"/aotx/v1/requests/{rid}/cancel")
        assert r.status_code == 202
        body = r.json()
        assert body["cancel_requested"] is True
        assert body["state"] in ("running", "cancelled")
        final = poll_until_terminal(c, rid)
        assert final["state"] == "cancelled" and final["cancel_requested"] is True
        assert final["usage"]["completion_tokens"] < 2000
        again = c.post(f"/aotx/v1/requests/{rid}/cancel").json()
        assert again["state"] == "cancelled"
        # A completed request stays completed when a cancel arrives after its stop.
        done = submit(c, max_tokens=4)
        poll_until_terminal(c, done)
        r = c.post(f"/aotx/v1/requests/{done}/cancel")
        assert r.status_code == 202 and r.json()["state"] == "completed"
        assert r.json()["cancel_requested"] is False


# -- standard routes -------------------------------------------------------------

def test_openai_streaming_matches_non_streaming(service: Service) -> None:
    client = openai.OpenAI(base_url=service.url + "/v1", api_key=service.token)
    args = dict(model="smollm2", messages=RUSSIAN, temperature=0, max_tokens=40, seed=1)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert "\ufffd" not in text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_raw_stream_ends_with_done(service: Service) -> None:
    with service.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "model": "smollm2", "messages": RUSSIAN, "max_tokens": 8, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_standard_stream_disconnect_cancels_on_the_device(service: Service) -> None:
    with service.client() as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": "smollm2", "messages": LONG, "max_tokens": 3000, "stream": True}) as r:
            rid = r.headers["x-request-id"]
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 3:
                    break  # the client goes away mid-stream
        final = poll_until_terminal(c, rid, timeout=30)
        assert final["state"] == "cancelled" and final["cancel_requested"] is True
        # capacity came back: a new request runs to completion
        assert poll_until_terminal(c, submit(c, max_tokens=4))["state"] == "completed"


def test_models_routes(service: Service) -> None:
    client = openai.OpenAI(base_url=service.url + "/v1", api_key=service.token)
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    raw = httpx.get(service.url + "/v1/models", headers=service.headers).json()
    assert raw["object"] == "list" and isinstance(raw["data"][0]["automatic_memory"], bool)
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[]", 400, None),
    (json.dumps({"model": "smollm2"}).encode(), 400, "messages"),
    (json.dumps({"model": "smollm2", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "smollm2", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": 5, "messages": RUSSIAN}).encode(), 400, "model"),
    (json.dumps({"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
     400, None),
    (json.dumps({"model": "nope", "messages": RUSSIAN}).encode(), 404, "model"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN, "n": 9}).encode(), 400, "n"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN, "temperature": "hot"}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN, "max_tokens": 0}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN, "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN, "stop": "é" * 513}).encode(), 400,
     "stop"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN, "max_tokens": 10**6}).encode(), 400,
     None),
    (json.dumps({"model": "smollm2", "messages": [
        {"role": "user", "content": "word " * 3000}]}).encode(), 400, None),
    (json.dumps({"model": "smollm2", "messages": [
        {"role": "user", "content": "x" * (2 << 20)}]}).encode(), 413, None),
    # values of another type are refused, as OpenAI does, not converted (strict bodies)
    *[(json.dumps({"model": "smollm2", "messages": RUSSIAN, field: value}).encode(), 400, field)
      for field, value in [("max_tokens", True), ("max_tokens", "3"), ("max_tokens", 3.0),
                           ("temperature", "0"), ("temperature", True), ("n", True),
                           ("seed", "7"), ("logprobs", "yes"), ("user", 5)]],
    (json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": 5}]}).encode(),
     400, "messages"),
    (json.dumps({"model": "smollm2", "messages": RUSSIAN,
                 "stream_options": {"include_usage": True}}).encode(), 400, None),
    # over the cap: the error names the field the client sent
    (json.dumps({"model": "smollm2", "messages": RUSSIAN,
                 "max_completion_tokens": 10**6}).encode(), 400, "max_completion_tokens"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/aotx/v1/requests"])
def test_bad_input_gets_a_clear_4xx(service: Service, route: str, body: bytes, status: int,
                                    param: str | None) -> None:
    r = httpx.post(service.url + route, content=body, timeout=60,
                   headers={**service.headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "code" in err and "param" in err
    if param:
        assert err["param"].split(".")[0] == param
    if param == "max_completion_tokens":
        assert err["message"].startswith("max_completion_tokens 1000000 exceeds"), err


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/embeddings", {"input": "Hi", "user": 5}, "user"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": "5"}, "max_output_tokens"),
    ("/v1/responses", {"input": "Hi", "stream": "yes"}, "stream"),
])
def test_values_of_another_type_are_refused_on_every_route(
        service: Service, route: str, body: dict[str, Any], param: str) -> None:
    body = {"model": "smollm2", **({} if "prompt" in body or "input" in body
                                   else {"messages": RUSSIAN}), **body}
    r = httpx.post(service.url + route, json=body, headers=service.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text


def test_an_integer_is_still_a_number(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(model="smollm2", messages=RUSSIAN,  # type: ignore[arg-type]
                                      temperature=1, top_p=1, max_tokens=2, seed=3)
    assert out.choices[0].message.content is not None


def test_a_body_sent_as_a_form_is_read_as_json(service: Service) -> None:
    """``curl -d '{...}'`` sends Content-Type application/x-www-form-urlencoded: the
    body is still the JSON request, on the fast path's route and on the others; what
    is not a JSON object is a 400 that says so."""
    form = {**service.headers, "Content-Type": "application/x-www-form-urlencoded"}
    body = {"model": "smollm2", "messages": RUSSIAN, "max_tokens": 2}
    r = httpx.post(service.url + "/v1/chat/completions", content=json.dumps(body),
                   headers=form, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = httpx.post(service.url + "/v1/embeddings", headers=form, timeout=60,
                   content=json.dumps({"model": "smollm2", "input": "Hi"}))
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) > 0, r.text
    r = httpx.post(service.url + "/v1/completions", content=b"model=smollm2&prompt=Hi",
                   headers=form, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body is not valid JSON"


@pytest.mark.parametrize("call,param,message", [
    (lambda c: c.chat.completions.create(model="smollm2", messages=[
        {"role": "user", "content": 5}]), "messages.0.content",
     "Input should be a string or an array, not an integer"),
    (lambda c: c.chat.completions.create(model="smollm2", messages=RUSSIAN,
                                         tool_choice="maybe"), "tool_choice",
     "Input should be 'none', 'auto', 'required' or an object, not \"maybe\""),
    (lambda c: c.embeddings.create(model="smollm2", input=[5.5]), "input.0",
     "Input should be a string, an integer or an array, not a number"),
    (lambda c: c.responses.create(model="smollm2", input=[{"type": "mess"}]), "input.0",
     'unknown type "mess"; expected one of "message", "function_call", '
     '"function_call_output", "reasoning"'),
])
def test_a_union_field_is_named_as_the_client_wrote_it(oai: openai.OpenAI, call: Any,
                                                       param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call(oai)
    assert isinstance(e.value.body, dict), e.value
    assert (e.value.param, e.value.body["message"]) == (param, f"{param}: {message}")


def test_native_refuses_stream_true(service: Service) -> None:
    with service.client() as c:
        r = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": RUSSIAN,
                                              "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_admission_fast_path_answers_as_the_route_does(service: Service) -> None:
    """A JSON body on POST /aotx/v1/requests is answered by the gateway's fast path;
    the same body as application/vnd.test+json (JSON to the framework, not to the fast
    path) goes through the framework's route.  Both
    must give the same status and the same document (ids aside)."""
    bad = {"Authorization": "Bearer nope"}
    cases = [
        (service.headers, {"model": "smollm2", "messages": RUSSIAN, "max_tokens": 2}),
        (service.headers, {"model": "smollm2", "messages": RUSSIAN, "stream": True}),
        (service.headers, {"model": "nope", "messages": RUSSIAN}),
        (service.headers, {"model": "smollm2", "messages": RUSSIAN, "max_tokens": 10**6}),
        (service.headers, {"model": "smollm2", "messages": RUSSIAN, "max_tokens": 1 << 40}),
        (service.headers, {"model": "smollm2", "messages": [
            {"role": "user", "content": "word " * 3000}]}),
        (service.headers, {"model": "smollm2", "messages": [
            {"role": "user", "content": [{"type": "input_image", "digest": "sha256:" + "0" * 64}]}]}),
        ({}, {"model": "smollm2", "messages": RUSSIAN}),
        (bad, {"model": "smollm2", "messages": RUSSIAN}),
    ]
    for headers, body in cases:
        raw = json.dumps(body).encode()
        fast = httpx.post(service.url + "/aotx/v1/requests", content=raw, timeout=60,
                          headers={**headers, "Content-Type": "application/json"})
        route = httpx.post(service.url + "/aotx/v1/requests", content=raw, timeout=60,
                           headers={**headers, "Content-Type": "application/vnd.test+json"})
        assert fast.status_code == route.status_code, (body, fast.text, route.text)
        assert fast.headers.get("www-authenticate") == route.headers.get("www-authenticate")
        a, b = fast.json(), route.json()
        if fast.status_code == 202:
            assert a.pop("id") != b.pop("id")
        assert a == b, body


def test_openapi_document(service: Service) -> None:
    doc = httpx.get(service.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/models", "/aotx/v1/requests",
                 "/aotx/v1/requests/{rid}", "/aotx/v1/requests/{rid}/events",
                 "/aotx/v1/requests/{rid}/cancel"):
        assert path in doc["paths"]
    assert "ChatRequest" in doc["components"]["schemas"]


# -- restarts and retention --------------------------------------------------------

def test_old_epoch_ids_answer_410_after_restart(fresh_service: Service) -> None:
    """Device 3 of several (docs/scale-out.md): its ids start with its number; after a
    restart its older ids are 410, and another device's ids are 404, never 410."""
    fresh_service.extra_args = ["--device-id", "3"]
    fresh_service.start()
    with fresh_service.client() as c:
        assert c.get("/aotx/v1/capabilities").json()["device_id"] == "3"
        rid = submit(c, max_tokens=4)
        assert rid.startswith("req-0003")
        poll_until_terminal(c, rid)
    fresh_service.stop()
    fresh_service.start()
    with fresh_service.client() as c:
        for method, path in (("GET", f"/aotx/v1/requests/{rid}"),
                             ("GET", f"/aotx/v1/requests/{rid}/events"),
                             ("POST", f"/aotx/v1/requests/{rid}/cancel")):
            r = c.request(method, path)
            assert r.status_code == 410, (path, r.text)
            assert r.json()["error"]["type"] == "gone_error"
        new = submit(c, max_tokens=4)
        assert int(new[4:20], 16) == int(rid[4:20], 16) + 1
        foreign = "req-0002" + rid[8:]  # device 2's id of the same activation count
        assert c.get(f"/aotx/v1/requests/{foreign}").status_code == 404


def test_terminal_results_are_reclaimed_oldest_first(fresh_service: Service) -> None:
    fresh_service.extra_args = ["--retention-requests", "2"]
    fresh_service.start()
    with fresh_service.client() as c:
        ids = []
        for _ in range(3):
            ids.append(submit(c, max_tokens=2))
            poll_until_terminal(c, ids[-1])
        deadline = time.monotonic() + 30  # the next retention pass: a state, not a speed
        while c.get(f"/aotx/v1/requests/{ids[0]}").status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.get(f"/aotx/v1/requests/{ids[1]}").status_code == 200
        assert c.get(f"/aotx/v1/requests/{ids[2]}").status_code == 200
