"""``/v1/responses`` (issue 21) end to end through the official ``openai`` client on the
real model: a background response polled to its end; its stream dropped and resumed
with ``starting_after`` (every event after N exactly once, the text the stored one); a
cancelled background response; ``previous_response_id``; ``json_schema`` output;
function calls and their results; another principal's response → 404; a deleted one →
404; and the response and native views of one request agreeing byte for byte."""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from ..helpers import Service
from .test_e2e_grants import mint

pytestmark = pytest.mark.e2e

STORY = "Write a long story about a dragon who learns to cook."
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER, "strict": True}


def until_done(oai: openai.OpenAI, rid: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        r = oai.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, "the response did not end"
        time.sleep(0.1)


def native_bytes(service: Service, rid: str) -> bytes:
    """Every output byte of the response's device request, by its native id."""
    native = "req-" + rid[5:21] + "-" + rid[21:]
    out, cursor = b"", 0
    with service.client() as c:
        while True:
            w = c.get(f"/aotx/v1/requests/{native}", params={"cursor": cursor}).json()["output"]
            out += base64.b64decode(w["bytes"])
            cursor = int(w["next_cursor"])
            if cursor >= int(w["total_bytes"]):
                return out


def test_background_response_polled_to_its_end_agrees_with_the_native_view(
        oai: openai.OpenAI, service: Service) -> None:
    raw = oai.responses.with_raw_response.create(
        model="smollm2", input=STORY, background=True, max_output_tokens=40, temperature=0,
        instructions="Answer in English.", metadata={"case": "background"})
    r = raw.parse()
    assert r.status in ("queued", "in_progress") and r.output_text == ""
    native = raw.headers["X-Request-Id"]
    assert native == "req-" + r.id[5:21] + "-" + r.id[21:]
    done = until_done(oai, r.id)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 40 and done.usage.input_tokens > 0
    assert done.instructions == "Answer in English." and done.metadata == {"case": "background"}
    assert done.background is True and done.output[0].type == "message"
    # One request, two views: the native bytes are the response's text, byte for byte.
    assert native_bytes(service, r.id) == done.output_text.encode("utf-8") != b""
    with service.client() as c:
        state = c.get(f"/aotx/v1/requests/{native}").json()
    assert state["usage"]["completion_tokens"] == done.usage.output_tokens


def _events(stream: Any, stop_after: int | None = None) -> list[Any]:
    got = []
    for ev in stream:
        got.append(ev)
        if stop_after is not None and ev.sequence_number >= stop_after:
            stream.close()  # the connection drops here
            break
    return got


def test_stream_resumed_after_a_dropped_connection(oai: openai.OpenAI, service: Service) -> None:
    first = _events(oai.responses.create(model="smollm2", input=STORY, background=True,
                                         stream=True, max_output_tokens=400, temperature=0),
                    stop_after=9)
    assert [e.sequence_number for e in first] == list(range(10))
    assert [e.type for e in first[:4]] == ["response.created", "response.in_progress",
                                           "response.output_item.added",
                                           "response.content_part.added"]
    rid = first[0].response.id
    native = "req-" + rid[5:21] + "-" + rid[21:]
    with service.client() as c:  # the resume below meets a request still generating
        assert c.get(f"/aotx/v1/requests/{native}").json()["state"] == "running"
    # The request ran on without its client; resume after event 9, drop again, resume.
    second = _events(oai.responses.retrieve(rid, stream=True, starting_after=9), stop_after=20)
    third = _events(oai.responses.retrieve(rid, stream=True, starting_after=20))
    seen = [e.sequence_number for e in first + second + third]
    assert seen == list(range(len(seen))), "every event after N exactly once, in order"
    assert third[-1].type == "response.incomplete"
    text = "".join(e.delta for e in first + second + third
                   if e.type == "response.output_text.delta")
    done = oai.responses.retrieve(rid)
    assert text == done.output_text != ""
    done_ev = [e for e in third if e.type == "response.output_text.done"]
    assert done_ev and done_ev[0].text == text
    assert third[-1].response.output_text == text
    # Event N is always the same event: a whole replay repeats every one of them.
    replay = _events(oai.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in first + second + third]


def test_cancelled_background_response(oai: openai.OpenAI, service: Service) -> None:
    r = oai.responses.create(model="smollm2", input=STORY, background=True,
                             max_output_tokens=2000, temperature=0.8)
    cancelled = oai.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    again = oai.responses.retrieve(r.id)
    assert again.status == "cancelled" and again.usage.output_tokens < 2000
    assert native_bytes(service, r.id) == again.output_text.encode("utf-8")
    events = _events(oai.responses.retrieve(r.id, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "cancelled"


def test_previous_response_id_continues_the_conversation(oai: openai.OpenAI) -> None:
    one = oai.responses.create(model="smollm2", input="My name is Zorblax. Remember it.",
                               max_output_tokens=20, temperature=0)
    two = oai.responses.create(model="smollm2", input="What is my name?",
                               previous_response_id=one.id, max_output_tokens=20,
                               temperature=0)
    alone = oai.responses.create(model="smollm2", input="What is my name?",
                                 max_output_tokens=20, temperature=0)
    assert two.previous_response_id == one.id and two.status in ("completed", "incomplete")
    # The second prompt held the first turn, its answer and the new question.
    assert (two.usage.input_tokens
            >= one.usage.input_tokens + one.usage.output_tokens + 5 > alone.usage.input_tokens)
    items = list(oai.responses.input_items.list(two.id, order="asc"))
    assert len(items) == 1 and items[0].content[0].text == "What is my name?"
    # A response that was not stored cannot be continued, nor its input listed.
    loose = oai.responses.create(model="smollm2", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model="smollm2", input="And?", previous_response_id=loose.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list(loose.id)
    assert oai.responses.retrieve(loose.id).store is False  # still the device's request


def test_json_schema_output_validates(oai: openai.OpenAI) -> None:
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.responses.create(
        model="smollm2", input="Invent a person.", max_output_tokens=80, temperature=0.7,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="smollm2", input="x", text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": "array",
                                                             "uniqueItems": True}}})
    assert err.value.body["param"] == "text.format"  # type: ignore[index]


def test_function_call_and_its_output(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="smollm2", input="What is the weather in Paris?",
                             tools=[TOOL], tool_choice="required", temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert calls[0].call_id.startswith("call_")
    # The call's result continues the conversation: the prompt holds the question, the
    # call and its result (the same tools offered).
    follow = oai.responses.create(
        model="smollm2", previous_response_id=r.id, tools=[TOOL], temperature=0,
        max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 21, "sky": "clear"}'}])
    assert follow.output and follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    # Streamed: each call's argument deltas add up to its arguments (up to 4 calls).
    events = list(oai.responses.create(model="smollm2", input="Weather in Rome?", tools=[TOOL],
                                       tool_choice="required", temperature=0, stream=True))
    args: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and {e.item_id: e.arguments for e in done} == args
    for e in done:
        assert e.name == "get_weather"
        jsonschema.validate(json.loads(e.arguments), WEATHER)
    assert events[-1].type == "response.completed"
    final = [o.model_dump() for o in events[-1].response.output]
    assert final == [o.model_dump() for o in oai.responses.retrieve(events[0].response.id).output]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_another_principals_response_is_not_found(oai: openai.OpenAI,
                                                  service: Service) -> None:
    r = oai.responses.create(model="smollm2", input="Hello", max_output_tokens=4,
                             background=True)
    other = openai.OpenAI(base_url=service.url + "/v1", api_key=mint(service, "resp-other"),
                          max_retries=0, timeout=60)
    for call in (lambda: other.responses.retrieve(r.id),
                 lambda: other.responses.cancel(r.id),
                 lambda: other.responses.delete(r.id),
                 lambda: other.responses.input_items.list(r.id),
                 lambda: list(other.responses.retrieve(r.id, stream=True)),
                 lambda: other.responses.create(model="smollm2", input="x",
                                                previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert until_done(oai, r.id).status in ("completed", "incomplete")  # untouched


def test_delete_makes_the_response_not_found(oai: openai.OpenAI, service: Service) -> None:
    r = oai.responses.create(model="smollm2", input=STORY, background=True,
                             max_output_tokens=2000)
    oai.responses.delete(r.id)
    for call in (lambda: oai.responses.retrieve(r.id),
                 lambda: oai.responses.input_items.list(r.id),
                 lambda: oai.responses.create(model="smollm2", input="x",
                                              previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    # Deleting cancelled it; the device still holds its bytes until its retention ends.
    native = "req-" + r.id[5:21] + "-" + r.id[21:]
    with service.client() as c:
        deadline = time.monotonic() + 30
        while (state := c.get(f"/aotx/v1/requests/{native}").json()["state"]) != "cancelled":
            assert time.monotonic() < deadline, state
            time.sleep(0.1)


def test_refusals_name_the_field(oai: openai.OpenAI, service: Service) -> None:
    for extra, param in (({"reasoning": {"effort": "extreme"}}, "reasoning"),
                         ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
                         ({"truncation": "auto"}, "truncation"),
                         ({"input": []}, "input"),
                         ({"metadata": {"k" * 65: "v"}}, "metadata"),
                         ({"background": True, "store": False}, None)):
        with pytest.raises(openai.BadRequestError) as err:
            oai.responses.create(model="smollm2", **{"input": "x", **extra})  # type: ignore[call-overload]
        got = err.value.body["param"]  # type: ignore[index]
        assert got == param or (param and got and got.startswith(param.split(".")[0])), got
    with httpx.Client(base_url=service.url, headers=service.headers) as c:
        assert c.get(f"/v1/responses/resp_{'0' * 47}x").status_code == 404
        assert c.get(f"/v1/responses/resp_{'0' * 16}{'ab' * 16}").status_code == 404
        r = c.get(f"/v1/responses/resp_{'0' * 15}9{'ab' * 16}")
        assert r.status_code == 404  # a future epoch names nothing


def requests_by_state(service: Service) -> dict[str, float]:
    text = httpx.get(service.url + "/metrics", headers=service.headers, timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^aotx_requests\{state="(\w+)"\} (\S+)$', text, re.M)}


def until(check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_waiting_client_that_leaves_cancels_its_response(service: Service) -> None:
    """Neither streamed nor in the background, a response lives as long as the connection
    that waits for it (docs/api.md): the client leaves, the device cancels the request."""
    until(lambda: requests_by_state(service).get("running", 0) == 0)
    cancelled = requests_by_state(service).get("cancelled", 0)
    body = json.dumps({"model": "smollm2", "input": STORY, "max_output_tokens": 3000}).encode()
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Authorization: " + service.headers["Authorization"].encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        until(lambda: requests_by_state(service).get("running", 0) == 1)
    until(lambda: requests_by_state(service).get("cancelled", 0) == cancelled + 1, 30)
    assert requests_by_state(service).get("running", 0) == 0


def test_created_at_is_the_same_on_every_read(oai: openai.OpenAI) -> None:
    """A response not stored, and a chat completion's request read as a response, keep
    one creation time (it used to be the time of each read)."""
    loose = oai.responses.create(model="smollm2", input="Hi", max_output_tokens=3, store=False)
    time.sleep(1.1)
    assert oai.responses.retrieve(loose.id).created_at == loose.created_at
    events = list(oai.responses.retrieve(loose.id, stream=True))
    assert events[0].response.created_at == loose.created_at  # type: ignore[union-attr]
    chat = oai.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    rid = "resp_" + chat.headers["x-request-id"][4:].replace("-", "")
    first = oai.responses.retrieve(rid)
    time.sleep(1.1)
    assert oai.responses.retrieve(rid).created_at == first.created_at
    assert first.store is False and first.instructions is None  # the defaults


def test_input_items_before_a_cursor_pages_backwards(oai: openai.OpenAI,
                                                     service: Service) -> None:
    """``before`` alone gives the page just before the cursor (OpenAI's and Stripe's
    previous page), in the list's order.  (The SDK's ``list`` does not send ``before``.)"""
    msgs = [{"role": "user", "content": f"Item {i}."} for i in range(5)]
    r = oai.responses.create(model="smollm2", input=msgs, max_output_tokens=2)  # type: ignore[arg-type]
    desc = [i.id for i in oai.responses.input_items.list(r.id)]
    assert len(desc) == 5

    def page(**params: Any) -> tuple[list[str], bool]:
        got = httpx.get(f"{service.url}/v1/responses/{r.id}/input_items", params=params,
                        headers=service.headers, timeout=30).json()
        return [i["id"] for i in got["data"]], got["has_more"]

    assert page(before=desc[3], limit=2) == (desc[1:3], True)
    assert page(before=desc[1], limit=2) == (desc[:1], False)
    assert page(after=desc[0], limit=2) == (desc[1:3], True)
    assert page(after=desc[0], before=desc[4], limit=2) == (desc[1:3], True)


def test_user_tags_are_taken_and_the_sampling_defaults_shown(oai: openai.OpenAI) -> None:
    """``user`` and ``safety_identifier`` as on chat completions (logged, not stored);
    ``temperature`` and ``top_p`` not given read 1.0, what sampling used, as OpenAI
    shows them (they read null)."""
    r = oai.responses.create(model="smollm2", input="Hi", max_output_tokens=2, user="u1",
                             safety_identifier="s1")
    assert (r.temperature, r.top_p) == (1.0, 1.0)
    assert oai.responses.retrieve(r.id).temperature == 1.0
    loose = oai.responses.create(model="smollm2", input="Hi", max_output_tokens=2,
                                 store=False)
    assert (loose.temperature, loose.top_p) == (1.0, 1.0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="smollm2", input="Hi", user="u" * 257)
    assert err.value.body["param"] == "user"  # type: ignore[index]
