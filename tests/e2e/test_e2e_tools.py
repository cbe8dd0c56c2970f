"""Tools (function calling) end to end through the official ``openai`` client (issue
20): ``tool_choice`` required, a named function, auto and none, stream and not,
temperatures 0 and 1.2 and several seeds; every call's arguments validate against its
function's parameters (jsonschema); a conversation with earlier calls and their results;
the refusals of bad names, duplicates and schemas that cannot be enforced."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from ..helpers import Service

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 40},
                   "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}},
    "required": ["query", "tags"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "Get the weather forecast for a city",
                                      "parameters": WEATHER_PARAMS, "strict": True}},
    {"type": "function", "function": {"name": "web-search", "description": "Search the web",
                                      "parameters": SEARCH_PARAMS}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "web-search"}}
TERMINAL = ("completed", "failed", "cancelled")


def check_calls(calls: list[Any], only: str | None = None) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in PARAMS and (only is None or c.function.name == only)
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)


def streamed(oai: openai.OpenAI, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls as assembled from delta.tool_calls, finish_reason)."""
    text, calls, finish = "", [], None
    for chunk in oai.chat.completions.create(model="smollm2", stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: index, id, type, name
                    assert d.index == len(calls) and d.type == "function"
                    assert d.function is not None and d.function.arguments == ""
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.index == len(calls) - 1 and d.function is not None
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return text, calls, finish


@pytest.mark.parametrize("temperature, seed", [(0, 1), (1.2, 1), (1.2, 2), (1.2, 3)])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_always_call(oai: openai.OpenAI, choice: str,
                                        temperature: float, seed: int) -> None:
    r = oai.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=400, temperature=temperature, seed=seed,
        tools=TOOLS, tool_choice=NAMED if choice == "named" else "required")  # type: ignore[arg-type]
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None
    check_calls(c.message.tool_calls or [], "web-search" if choice == "named" else None)


@pytest.mark.parametrize("temperature, seed", [(0, 4), (1.2, 5), (1.2, 6)])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls(oai: openai.OpenAI, choice: str, temperature: float,
                        seed: int) -> None:
    text, calls, finish = streamed(
        oai, messages=ASK, max_tokens=400, temperature=temperature, seed=seed, tools=TOOLS,
        tool_choice=NAMED if choice == "named" else "required", parallel_tool_calls=False)
    assert finish == "tool_calls" and text == ""
    assert len(calls) == 1
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "web-search" or choice == "required"
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


@pytest.mark.parametrize("temperature, seed", [(0, 7), (1.2, 7), (1.2, 8)])
def test_auto_answers_text_or_a_valid_call(oai: openai.OpenAI, temperature: float,
                                           seed: int) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=200,
                                    temperature=temperature, seed=seed, tools=TOOLS)  # type: ignore[arg-type]
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content
        assert "<tool_call>" not in c.message.content
    text, calls, finish = streamed(oai, messages=ASK, max_tokens=200,
                                   temperature=temperature, seed=seed, tools=TOOLS)
    if calls:
        assert finish == "tool_calls"
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    else:
        assert finish in ("stop", "length") and text and "<tool_call>" not in text
    # Greedy and seeded: the stream answers as the whole response did.
    assert bool(calls) == bool(c.message.tool_calls)


def test_logprobs_cover_text_and_calls(oai: openai.OpenAI) -> None:
    """Every generated token's logprob, the call's markup included (the device's tokens);
    a stream sends each once, the held call's with its first delta."""
    kw: dict[str, Any] = dict(model="smollm2", messages=ASK, max_tokens=300, temperature=0,
                              tools=TOOLS, tool_choice=NAMED, logprobs=True, top_logprobs=1,
                              parallel_tool_calls=False)
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.logprobs and c.logprobs.content
    whole = [t.token for t in c.logprobs.content]
    joined = "".join(whole)
    assert joined.startswith("<tool_call>\n") and '"web-search"' in joined
    # every sampled token (usage also counts an end-of-generation token, which has no text,
    # where the grammar let the model end the answer)
    assert len(whole) in (r.usage.completion_tokens - 1, r.usage.completion_tokens)  # type: ignore[union-attr]
    streamed: list[str] = []
    first_call_lps = None
    arguments = ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            lps = [t.token for t in (ch.logprobs.content or [])] if ch.logprobs else []
            if ch.delta.tool_calls and first_call_lps is None:
                first_call_lps = lps
            streamed += lps
            for d in ch.delta.tool_calls or []:
                arguments += d.function.arguments or "" if d.function else ""
    # (not compared with the whole answer token for token: a near tie may go either way
    # between a fresh prompt and a cached one)
    assert first_call_lps == streamed
    text = "".join(streamed)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert call["name"] == "web-search" and call["arguments"] == json.loads(arguments)


def test_auto_may_write_text_before_a_call(oai: openai.OpenAI, service: Service) -> None:
    """A sentence, then a call: the sentence is the content, the call is parsed and
    valid, stream and not.  Shown the pattern, SmolLM2 writes the sentence but then
    "<tool_response>" (its own guess at a result).  A bias on the token "call", sized
    from the native logprobs of that answer (the gap to "response" there, plus a margin
    of 2 that numerical noise between runs cannot cross), tips it into the call."""
    shot = {"city": "Oslo", "unit": "celsius", "days": 1}
    messages = [
        {"role": "user", "content": "What is the weather like in Oslo today?"},
        {"role": "assistant", "content": "Let me check the forecast for you.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": json.dumps(shot)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "rain"}'},
        {"role": "assistant", "content": "It rains in Oslo today."}, *ASK]
    with service.client() as http:
        rid = http.post("/aotx/v1/requests", json={
            "model": "smollm2", "messages": messages, "max_tokens": 14, "temperature": 0,
            "tools": TOOLS, "logprobs": True, "top_logprobs": 20}).json()["id"]
        lines: list[dict[str, Any]] = []
        for _ in range(600):
            doc = http.get(f"/aotx/v1/requests/{rid}/logprobs").json()
            lines = doc["logprobs"]["content"]  # one window holds these 14 tokens
            if doc["state"] in TERMINAL:
                break
            time.sleep(0.1)
    fork = next(line for line in lines if line["token"] == "response")
    call = next(t for t in fork["top_logprobs"] if t["token"] == "call")
    bias = fork["logprob"] - call["logprob"] + 2
    assert 0 < bias < 12, bias  # more would make "call" win elsewhere too
    kw: dict[str, Any] = dict(messages=messages, max_tokens=300, temperature=0, tools=TOOLS,
                              logit_bias={str(call["token_id"]): bias})
    r = oai.chat.completions.create(model="smollm2", **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content and "<tool" not in c.message.content
    check_calls(c.message.tool_calls or [])
    text, calls, finish = streamed(oai, **kw)
    assert (text, finish) == (c.message.content, "tool_calls")
    assert [x["arguments"] for x in calls] == [
        x.function.arguments for x in c.message.tool_calls or []]


def test_none_answers_text(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40,
                                    temperature=0, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content
    assert c.finish_reason in ("stop", "length")


def test_a_conversation_with_calls_and_results(oai: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are a weather assistant."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_abc",
         "content": '{"forecast": "sunny", "temperature": 24}'}]
    r = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=60,
                                    temperature=0, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
    assert r.choices[0].message.content
    # The same history may go on calling.
    r = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=300,
                                    temperature=0, tools=TOOLS, tool_choice="required")  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls or [])


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    f: dict[str, Any] = {"name": name}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


@pytest.mark.parametrize("tools, choice, words", [
    ([_tool("get weather")], "auto", "name"),
    ([_tool("x" * 65)], "auto", "name"),
    ([_tool("f"), _tool("f")], "auto", "duplicate"),
    ([_tool("f", {"type": "array"})], "auto", "object"),
    ([_tool("f")], {"type": "function", "function": {"name": "g"}}, "not in tools"),
    ([_tool("ok"), _tool("f", {"type": "object", "properties": {
        "a": {"type": "string", "maxlength": 3}}})], "required", "'f'"),
    ([_tool("f", {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}})], "auto", "uniqueItems"),
    ([_tool("f", {"type": "object", "properties": {"a": {"type": "strnig"}}})], "auto", None),
])
def test_bad_tools_answer_400(oai: openai.OpenAI, tools: list[Any], choice: Any,
                              words: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=10,
                                    tools=tools, tool_choice=choice)
    body = err.value.body
    assert isinstance(body, dict), body
    if words:
        assert words in body["message"], body


def test_schema_refusals_name_the_function(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=10, tool_choice="auto",
            tools=[_tool("ok"), _tool("bad", {"type": "object", "properties": {
                "a": {"type": "string", "maxlength": 3}}})])
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "tools", body
    assert body["code"] == "invalid_schema"
    assert "'bad'" in body["message"] and "maxlength" in body["message"], body
    assert "#/properties/a" in body["message"], body


def test_the_native_route_takes_tools(service: Service) -> None:
    """The same fields on POST /aotx/v1/requests; the call is in the byte output in the
    fallback format."""
    import base64

    h = {"Authorization": f"Bearer {service.token}"}
    with httpx.Client(base_url=service.url, headers=h, timeout=60) as http:
        r = http.post("/aotx/v1/requests", json={
            "model": "smollm2", "messages": ASK, "max_tokens": 300, "temperature": 0,
            "tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False})
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        for _ in range(600):
            doc = http.get(f"/aotx/v1/requests/{rid}").json()
            if doc["state"] in TERMINAL:
                break
            time.sleep(0.1)
        text = base64.b64decode(doc["output"]["bytes"]).decode()
    assert text.startswith('<tool_call>\n{"name": "web-search", "arguments": ')
    assert text.endswith("}\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    jsonschema.validate(call["arguments"], SEARCH_PARAMS)
    with httpx.Client(base_url=service.url, headers=h, timeout=60) as http:
        parsed = http.get(f"/aotx/v1/requests/{rid}/tool_calls").json()
    assert parsed["schema"] == "aotx.tool_calls.v1" and parsed["tools"] is True
    assert parsed["state"] == "completed" and parsed["message"]["content"] is None
    (got,) = parsed["message"]["tool_calls"]
    assert got["function"]["name"] == "web-search" and got["id"].startswith("call_")
    assert json.loads(got["function"]["arguments"]) == call["arguments"]


def test_the_native_and_standard_views_of_calls_agree(service: Service,
                                                       oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model="smollm2", messages=ASK, max_tokens=400, temperature=0, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required")
    message = raw.parse().choices[0].message
    rid = raw.headers["x-request-id"]
    with service.client() as http:
        doc = http.get(f"/aotx/v1/requests/{rid}/tool_calls").json()
        assert http.get(f"/aotx/v1/requests/{rid}").json()["tools"] is True
        plain = oai.chat.completions.with_raw_response.create(
            model="smollm2", messages=ASK, max_tokens=2, temperature=0)
        refused = http.get(f"/aotx/v1/requests/{plain.headers['x-request-id']}/tool_calls")
    assert [c.model_dump() for c in message.tool_calls or []] == doc["message"]["tool_calls"]
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_tools"
