"""Anthropic's Messages API (issue 43) through the official ``anthropic`` SDK on the real
model: plain, streamed (the SDK's own stream helpers assemble the message), stop
sequences named, tools with a ``tool_use`` → ``tool_result`` round trip, ``count_tokens``
equal to the usage, ``x-api-key`` and bearer auth, errors in Anthropic's envelope,
another principal's 404s, and a replay of what Claude Code sends.  (An image block:
tests/e2e/test_e2e_vision.py, which has a projector.)"""

from __future__ import annotations

import json
import os
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from ..helpers import Service
from .test_e2e_grants import mint

pytestmark = pytest.mark.e2e

GREEDY: dict[str, Any] = {"temperature": 0}  # (the SDK sends it as an extra field now)
QUESTION = [{"role": "user", "content": "Count: 1, 2, 3,"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(service: Service) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=service.url, api_key=service.token, max_retries=0,
                               timeout=120)


def create(c: anthropic.Anthropic, **kw: Any) -> Any:
    kw.setdefault("model", "smollm2")
    kw.setdefault("max_tokens", 24)
    kw.setdefault("messages", QUESTION)
    return c.messages.create(extra_body=GREEDY, **kw)


def text_of(m: Any) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_a_message_and_its_count(claude: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    m = create(claude, system=system)
    assert m.type == "message" and m.role == "assistant" and m.model == "smollm2"
    assert m.id.startswith("msg_") and text_of(m)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    counted = claude.messages.count_tokens(model="smollm2", messages=QUESTION, system=system)
    assert counted.input_tokens == m.usage.input_tokens > 0
    assert 0 < m.usage.output_tokens <= 24
    short = create(claude, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_a_stop_sequence_is_named(claude: anthropic.Anthropic) -> None:
    """llama-server reports end_turn here; Anthropic's API names the sequence."""
    whole = text_of(create(claude))
    words = whole.split(" ")
    assert len(words) >= 3, whole
    stop = " " + words[2]
    m = create(claude, stop_sequences=["never-there", stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert text_of(m) == whole[:whole.index(stop)]
    with claude.messages.stream(model="smollm2", max_tokens=24, messages=QUESTION,
                                stop_sequences=[stop], extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_the_sdks_stream_assembles_the_same_message(claude: anthropic.Anthropic) -> None:
    whole = create(claude)
    pieces: list[str] = []
    with claude.messages.stream(model="smollm2", max_tokens=24, messages=QUESTION,
                                extra_body=GREEDY) as s:
        pieces.extend(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_streams_events_come_in_anthropics_order(service: Service) -> None:
    body = {"model": "smollm2", "max_tokens": 8, "messages": QUESTION, "stream": True,
            "temperature": 0}
    with httpx.Client(base_url=service.url, timeout=60) as c, c.stream(
            "POST", "/v1/messages", json=body, headers={"x-api-key": service.token,
                                                         "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [(line[7:], None) for line in r.iter_lines() if line.startswith("event: ")]
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}


def test_tool_any_gives_a_call_and_the_result_comes_back(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    one = {"type": "any", "disable_parallel_tool_use": True}
    m = create(claude, messages=ask, tools=[WEATHER], tool_choice=one, max_tokens=300)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    # the same, streamed: the SDK joins the input_json_delta fragments
    with claude.messages.stream(model="smollm2", max_tokens=300, messages=ask,
                                tools=[WEATHER], tool_choice=one, extra_body=GREEDY) as s:
        final = s.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert final.stop_reason == "tool_use"
    # the round trip: the call, its result, then the answer
    turns = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                     for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "Sunny, 24 degrees."}]}]
    answer = create(claude, messages=turns, tools=[WEATHER], max_tokens=32)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model="smollm2", messages=turns, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens
    # the result is in the prompt: a longer result, a longer prompt
    turns[-1]["content"][0]["content"] = "Sunny, 24 degrees, light wind from the west."
    longer = claude.messages.count_tokens(model="smollm2", messages=turns, tools=[WEATHER])
    assert longer.input_tokens > counted.input_tokens


def test_a_named_tool_and_none(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Hello."}]
    named = create(claude, messages=ask, tools=[WEATHER], max_tokens=300,
                   tool_choice={"type": "tool", "name": "get_weather",
                                "disable_parallel_tool_use": True})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    none = create(claude, messages=ask, tools=[WEATHER], tool_choice={"type": "none"})
    assert not [b for b in none.content if b.type == "tool_use"]
    assert none.stop_reason != "tool_use"


def test_output_config_format_is_a_json_schema(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    m = create(claude, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=40,
               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(text_of(m)), schema)


def test_auth_by_x_api_key_or_bearer_and_its_errors(service: Service) -> None:
    bearer = anthropic.Anthropic(base_url=service.url, auth_token=service.token, max_retries=0)
    assert text_of(create(bearer, max_tokens=2))
    wrong = anthropic.Anthropic(base_url=service.url, api_key="not-a-token", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as got:
        create(wrong, max_tokens=2)
    assert got.value.body["type"] == "error"
    assert got.value.body["error"]["type"] == "authentication_error"


def test_errors_are_in_anthropics_envelope(service: Service, claude: anthropic.Anthropic
                                           ) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(claude, model="claude-opus-4-8")  # any model name is not accepted
    assert missing.value.body["error"]["type"] == "not_found_error"
    headers = {"x-api-key": service.token, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=service.url, timeout=60, headers=headers) as c:
        for body, field in (({"model": "smollm2", "messages": QUESTION}, "max_tokens"),
                            ({"model": "smollm2", "max_tokens": 5, "messages": QUESTION,
                              "bogus": 1}, "bogus"),
                            ({"model": "smollm2", "max_tokens": 5, "messages": [
                                {"role": "user", "content": [{"type": "document"}]}]},
                             "document"),
                            ({"model": "smollm2", "max_tokens": 5, "messages": [
                                *QUESTION, {"role": "assistant", "content": "4,"}]},
                             "prefill")):
            r = c.post("/v1/messages", json=body)
            assert r.status_code == 400, r.text
            doc = r.json()
            assert doc["type"] == "error" and set(doc) == {"type", "error"}
            assert doc["error"]["type"] == "invalid_request_error"
            assert field in doc["error"]["message"], doc
        r = c.post("/v1/messages", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        # other routes keep OpenAI's object
        assert "type" not in c.post("/v1/chat/completions", content=b"{").json()


def test_another_principal_gets_the_same_404s(service: Service) -> None:
    token = mint(service, "messages-other", "--models", "other-model")
    other = anthropic.Anthropic(base_url=service.url, api_key=token, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as run:
        create(other, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError) as count:
        other.messages.count_tokens(model="smollm2", messages=QUESTION)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        create(other, model="no-such-model", max_tokens=2)
    assert run.value.body["error"]["message"].replace("smollm2", "X") == \
        unknown.value.body["error"]["message"].replace("no-such-model", "X")
    assert count.value.body == run.value.body


REPLAY = os.path.join(os.path.dirname(__file__), "..", "data", "claude-code", "replay.json")


def test_claude_codes_requests_are_answered(service: Service) -> None:
    """What Claude Code sends at start and on a tool turn (tests/data/claude-code: its
    headers, ``?beta=true``, cache_control everywhere, thinking, context_management,
    output_config, max_tokens 32,000, earlier thinking and tool_result blocks) is
    answered with no error.  (Its ``ANTHROPIC_AUTH_TOKEN`` is a bearer token: tested
    above.)"""
    with open(REPLAY) as f:
        replay = json.load(f)
    headers = {**replay["headers"], "x-api-key": service.token}
    with httpx.Client(base_url=service.url, timeout=300, headers=headers) as c:
        for req in replay["requests"]:
            body = json.loads(json.dumps(req["body"]).replace('"MODEL"', '"smollm2"'))
            if not body.get("stream"):
                r = c.post(req["path"], json=body)
                assert r.status_code == 200, (req["name"], r.text)
                assert r.json()["input_tokens" if "count" in req["path"] else "type"], r.text
                continue
            with c.stream("POST", req["path"], json=body) as r:
                assert r.status_code == 200, (req["name"], r.read())
                kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
            assert "error" not in kinds and kinds[-1] == "message_stop", (req["name"], kinds)
