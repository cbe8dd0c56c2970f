"""Structured outputs end to end through the official ``openai`` client (issue 20):
``response_format`` ``json_object`` and ``json_schema`` (stream and not, temperatures 0
and 1.2, several seeds), ``chat.completions.parse`` with a pydantic model, and the
refusals that name what cannot be enforced."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..helpers import Service

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
        "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                            {"type": "null"}]},
    },
    "required": ["name", "age", "role", "email", "tags", "home", "score"],
    "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "zip": {"const": "12345"}},
        "required": ["city", "zip"], "additionalProperties": False}},
}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def grammar_metrics(service: Service) -> dict[str, float]:
    text = httpx.get(service.url + "/metrics", headers=service.headers, timeout=10).text
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
            if f.name.startswith("aotx_grammar_")}


def test_the_masks_cost_is_in_the_metrics(service: Service, oai: openai.OpenAI) -> None:
    before = grammar_metrics(service)
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60,
                                    temperature=0, response_format=schema_format(PERSON))  # type: ignore[arg-type]
    after = grammar_metrics(service)
    grew = {k: after[k] - before[k] for k in after}
    assert r.usage is not None
    # a mask for every token sampled under the grammar (the last may be EOS)
    assert grew["aotx_grammar_masks"] >= r.usage.completion_tokens - 1 > 0
    assert grew["aotx_grammar_steps"] >= r.usage.completion_tokens - 1
    assert grew["aotx_grammar_fill_seconds"] > 0
    assert 0 <= grew["aotx_grammar_wait_seconds"] <= grew["aotx_grammar_fill_seconds"] + 0.05


@pytest.mark.parametrize("temperature, seed", [(0, 1), (1.2, 1), (1.2, 2), (1.2, 3)])
def test_json_schema_output_validates(oai: openai.OpenAI, temperature: float,
                                      seed: int) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=300,
                                    temperature=temperature, seed=seed,
                                    response_format=schema_format(PERSON))  # type: ignore[arg-type]
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


@pytest.mark.parametrize("temperature, seed", [(0, 4), (1.2, 5)])
def test_json_schema_stream_validates(oai: openai.OpenAI, temperature: float,
                                      seed: int) -> None:
    text, finish = "", None
    for chunk in oai.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=300, temperature=temperature, seed=seed,
            stream=True, response_format=schema_format(PERSON)):  # type: ignore[arg-type]
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_one_object(oai: openai.OpenAI) -> None:
    # (greedy, ASK's person runs a number on past any max_tokens: ",000,000,..." a token)
    ask = [{"role": "user", "content": "Describe a fictional person as a JSON object."}]
    r = oai.chat.completions.create(model="smollm2", messages=ask, max_tokens=200,
                                    temperature=0, seed=1,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_holds_at_a_high_temperature(oai: openai.OpenAI) -> None:
    """At 1.2 this model runs a string past max_tokens in some samples (about 5 in 12,
    and which ones changes with the build's numerics): every choice that stops is one
    object, every other is cut off inside one, and some stop."""
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=200,
                                    temperature=1.2, seed=2, n=6,
                                    response_format={"type": "json_object"})
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(c.message.content or ""), dict)
                           for c in stopped)
    for c in r.choices:
        if c.finish_reason != "stop":
            assert c.finish_reason == "length" and (c.message.content or "").startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(c.message.content or "")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=4)


def test_parse_with_a_pydantic_model(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Invent a pet."}],
        max_tokens=100, temperature=0, response_format=Pet)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish")


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxlength": 3}}}, "maxlength"),
    ({"type": "strnig"}, None),
])
def test_what_cannot_be_enforced_is_refused_by_name(oai: openai.OpenAI,
                                                    schema: dict[str, Any],
                                                    words: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=10,
                                    response_format=schema_format(schema))  # type: ignore[arg-type]
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "response_format", body
    assert body["code"] == "invalid_schema"
    if words:
        assert words in body["message"], body


@pytest.mark.parametrize("rf", [{"type": "xml"}, {"type": "json_schema"},
                                {"type": "json_schema", "json_schema": {"name": "a b"}}])
def test_malformed_response_formats_answer_400(oai: openai.OpenAI, rf: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=10,
                                    response_format=rf)  # type: ignore[arg-type]


def _counters(service: Service) -> dict[str, float]:
    """The device's counters (the first sample of each family: one model here)."""
    text = httpx.get(service.url + "/metrics", headers=service.headers, timeout=10).text
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
            if f.samples}


def test_pathological_schemas_never_stall_other_streams(service: Service,
                                                        oai: openai.OpenAI) -> None:
    """A huge enum and deep nesting are refused before admission and a catastrophic
    pattern is bounded, while another stream runs; that stream's tokens keep coming.

    Counted, not timed: on a loaded machine a stream alone has gaps of seconds between
    its tokens, so the checks are what the device did (admissions, masks, the stream's
    tokens decoded beside the constrained request); the one timing, the engine's waits
    for masks, is bounded by the same request's own time."""
    finish: list[str | None] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in oai.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=120, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)

    runner = threading.Thread(target=stream)
    runner.start()
    assert started.wait(120)  # the stream is decoding: admitted, its prompt evaluated
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    before = _counters(service)
    for schema in ({"enum": [f"value-{i}" for i in range(200_000)]}, deep):
        with pytest.raises(openai.APIStatusError) as err:
            oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=20,
                                        response_format=schema_format(schema))  # type: ignore[arg-type]
        assert err.value.status_code in (400, 413), err.value
    refused = _counters(service)
    # refused before admission: no slot taken, no mask filled
    assert refused["aotx_requests_admitted"] == before["aotx_requests_admitted"]
    assert refused["aotx_grammar_masks"] == before["aotx_grammar_masks"]
    t0 = time.monotonic()
    r = oai.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=20,
        response_format=schema_format({"type": "string",  # type: ignore[arg-type]
                                        "pattern": "^(a+)+(b+)+(c+)+(d+)+(e+)+$"}))
    took = time.monotonic() - t0
    after = _counters(service)
    runner.join(120)
    assert not runner.is_alive() and len(finish) == 1, finish  # the stream ended as it should
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 20
    own = r.usage.completion_tokens
    grew = {k: after[k] - refused[k] for k in ("aotx_requests_admitted",
                                               "aotx_grammar_masks", "aotx_completion_tokens",
                                               "aotx_grammar_wait_seconds")}
    assert grew["aotx_requests_admitted"] == 1
    # bounded: a mask for each of its tokens (the last may be EOS), no more
    assert own - 1 <= grew["aotx_grammar_masks"] <= own + 1, grew
    # The stream was decoded beside it, a token in each of its steps, not held back
    # until it was done (the stream had ~100 of its 120 tokens still to go).
    beside = grew["aotx_completion_tokens"] - own
    assert beside >= own // 2, (beside, own)
    # What the masks cost the engine thread's steps, beyond the decode they overlap, is a
    # small part of the request's own time (~1 ms of seconds on 2 cores).
    assert grew["aotx_grammar_wait_seconds"] <= took / 10, (grew, took)


OPEN_CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                             "required": ["city"]}


def test_an_object_takes_only_the_properties_its_schema_lists(oai: openai.OpenAI) -> None:
    """Without ``additionalProperties`` the model invented keys at temperature 0 (the QA
    pass: ``{"city": "Paris", "temperature": 25}`` for a schema of ``city`` alone);
    they are refused now, as llama.cpp and vLLM refuse them, in a response format and
    in a tool's arguments (tests/unit/test_closed_objects.py: what keeps them allowed)."""
    weather = [{"role": "user", "content": "What is the weather in Paris? Answer as JSON."}]
    for strict in (True, False):
        r = oai.chat.completions.create(
            model="smollm2", messages=weather, temperature=0, max_tokens=60,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {  # type: ignore[typeddict-item]
                "name": "w", "strict": strict, "schema": OPEN_CITY}})
        assert set(json.loads(r.choices[0].message.content or "")) == {"city"}
        tool = {"type": "function", "function": {"name": "get_weather", "strict": strict,
                                                  "parameters": OPEN_CITY}}
        r = oai.chat.completions.create(model="smollm2", messages=weather, temperature=0,  # type: ignore[arg-type]
                                        max_tokens=60, tools=[tool],  # type: ignore[list-item]
                                        tool_choice="required")
        calls = r.choices[0].message.tool_calls or []
        assert calls and all(set(json.loads(c.function.arguments)) == {"city"}  # type: ignore[union-attr]
                             for c in calls)
