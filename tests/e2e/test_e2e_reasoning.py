"""Reasoning models (issue 43) on the embedded SmolLM2 with thinking templates: Qwen 3's
own (the model opens ``<think>`` itself; ``enable_thinking: false`` closes the block in
the prompt), one in DeepSeek R1's way (tests/data/think-open.jinja: the prompt opens
the block) and gpt-oss's channels; and on Gemma 3 270M (another vocabulary) with Qwen
3's.  Neither model thinks on its own, so a JSON schema steers it: the device puts the
schema after a think block of at most half of max_tokens, which the grammar makes the
model write and close.  The thinking and the answer are told apart on chat (whole
and streamed: ``reasoning_content``) and on Messages (``thinking`` blocks); the native
route keeps the bytes as the model wrote them."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from ..helpers import Service, gemma_path, running_service, with_templates

pytestmark = pytest.mark.e2e

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
QWEN3 = os.path.join(DATA, "templates", "Qwen-Qwen3-0.6B.jinja")
OPEN = os.path.join(DATA, "think-open.jinja")
HARMONY = os.path.join(DATA, "harmony.jinja")  # gpt-oss's channels
SCHEMA: dict[str, Any] = {"type": "object",
                          "properties": {"colour": {"type": "string", "maxLength": 12}},
                          "required": ["colour"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    models = with_templates((("qwen3-tmpl", QWEN3), ("open-tmpl", OPEN),
                             ("harmony-tmpl", HARMONY)))
    # a second real model, of another vocabulary (Gemma's), with Qwen 3's template
    models += (f'\n[[model]]\nalias = "gemma-qwen3-tmpl"\npath = "{gemma_path()}"\n'
               f'chat_template = "{QWEN3}"\nslots = 2\ncontext = 2048\n')
    with running_service(models=models) as s:
        yield s


@pytest.fixture(scope="module")
def oai(svc: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0,
                         timeout=120)


def chat(oai: openai.OpenAI, model: str, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 80)
    return oai.chat.completions.create(model=model, temperature=0, **kw)


def streamed(oai: openai.OpenAI, model: str, **kw: Any) -> tuple[str, str, str | None]:
    thought, content, finish = "", "", None
    for chunk in chat(oai, model, stream=True, **kw):
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return thought, content, finish


@pytest.mark.parametrize("model", ["qwen3-tmpl", "open-tmpl", "harmony-tmpl",
                                   "gemma-qwen3-tmpl"])
def test_a_schema_answer_comes_after_the_thinking(oai: openai.OpenAI, model: str) -> None:
    r = chat(oai, model, response_format=FORMAT)
    m = r.choices[0].message
    thought = getattr(m, "reasoning_content", None)
    assert isinstance(thought, str) and thought  # the openai SDK reads the field
    # (the markup is gone from the answer; SmolLM2 may imitate the prompt's inside its
    # thought, which is the model's text)
    assert not any(t in (m.content or "") for t in
                   ("<think>", "</think>", "<|channel|>", "<|message|>", "<|start|>"))
    assert not thought.startswith(("<think>", "<|channel|>analysis"))
    jsonschema.validate(json.loads(m.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    # the tokens it spent thinking, tags included: most of its output, not all
    spent = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < spent < r.usage.completion_tokens
    # the same answer streamed, its thinking in reasoning_content deltas
    assert streamed(oai, model, response_format=FORMAT) == (thought, m.content, "stop")


def test_a_model_that_closes_its_thinking_itself_gets_its_schema(oai: openai.OpenAI) -> None:
    """Asked to, SmolLM2 writes ``</think>`` itself, a token at a time; with the tag as
    the thought's ``stop`` llguidance panicked at ``</think`` and all 12 of 12 such
    requests failed (500).  Now the tag is the thought's suffix; a thought that runs to
    its budget (half of max_tokens) is closed by the matcher."""
    spent = []
    for seed in range(4):
        ask = [{"role": "user", "content": "Think, then close your thinking with </think> "
                f"and name a colour. Example: <think>I like red.</think> ({seed})"}]
        r = oai.chat.completions.create(model="qwen3-tmpl", messages=ask,  # type: ignore[arg-type]
                                        response_format=FORMAT,  # type: ignore[arg-type]
                                        max_tokens=300, temperature=1.0, seed=seed)
        m = r.choices[0].message
        jsonschema.validate(json.loads(m.content), SCHEMA)
        assert isinstance(getattr(m, "reasoning_content", None), str)
        spent.append(r.usage.completion_tokens_details.reasoning_tokens)
    assert min(spent) < 150, spent  # (one closed it before its budget at least)


def test_the_native_route_keeps_the_bytes(svc: Service) -> None:
    with svc.client() as c:
        r = c.post("/aotx/v1/requests", json={"model": "qwen3-tmpl", "messages": ASK,
                                              "max_tokens": 80, "temperature": 0,
                                              "response_format": FORMAT})
        rid = r.json()["id"]
        deadline = time.monotonic() + 60  # a state to wait for, not a speed
        while (doc := c.get(f"/aotx/v1/requests/{rid}").json())["state"] != "completed":
            assert time.monotonic() < deadline, doc["state"]
            time.sleep(0.05)
        # the parsed view beside the bytes: the thinking apart, as chat shows it
        parsed = c.get(f"/aotx/v1/requests/{rid}/message").json()
        plain = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": ASK,
                                                  "max_tokens": 4}).json()["id"]
        other = c.get(f"/aotx/v1/requests/{plain}/message").json()
    raw = base64.b64decode(doc["output"]["bytes"]).decode()
    assert raw.startswith("<think>") and "</think>" in raw
    jsonschema.validate(json.loads(raw.split("</think>")[1]), SCHEMA)
    assert parsed["schema"] == "aotx.message.v1" and parsed["state"] == "completed"
    thought, answer = raw[len("<think>"):].split("</think>")
    assert parsed["message"] == {"role": "assistant", "content": answer.lstrip("\n"),
                                 "reasoning_content": thought.strip("\n")}
    # a model that does not think: its text (so far) as content, no reasoning_content
    assert set(other["message"]) == {"role", "content"}


def test_enable_thinking_false_gives_no_thinking(oai: openai.OpenAI) -> None:
    r = chat(oai, "qwen3-tmpl", response_format=FORMAT,
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details is None  # (a request that does not think)
    jsonschema.validate(json.loads(m.content), SCHEMA)


def test_an_answer_cut_off_while_thinking_has_no_content(oai: openai.OpenAI) -> None:
    """The R1-style template opens the block: all SmolLM2 writes is thinking."""
    r = chat(oai, "open-tmpl", max_tokens=12)
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) and not m.content
    assert r.choices[0].finish_reason == "length"
    thought, content, finish = streamed(oai, "open-tmpl", max_tokens=12)
    assert (thought, content, finish) == (m.reasoning_content, "", "length")


def test_a_model_that_does_not_open_the_block_answers_as_it_is(oai: openai.OpenAI) -> None:
    r = chat(oai, "qwen3-tmpl", max_tokens=12)
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content


def test_messages_show_thinking_blocks(svc: Service) -> None:
    claude = anthropic.Anthropic(base_url=svc.url, api_key=svc.token, max_retries=0)
    kw: dict[str, Any] = dict(model="qwen3-tmpl", max_tokens=80, messages=ASK,
                              extra_body={"temperature": 0},
                              thinking={"type": "enabled", "budget_tokens": 30},
                              output_config={"format": {"type": "json_schema",
                                                        "schema": SCHEMA}})
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    jsonschema.validate(json.loads(m.content[1].text), SCHEMA)
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == m.content[0].thinking
    # display "omitted": the thinking block is there, without its text
    kw["thinking"] = {"type": "enabled", "budget_tokens": 30, "display": "omitted"}
    hidden = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content[:1]] == [
        ("thinking", "")] and hidden.content[1].text == m.content[1].text
    with claude.messages.stream(**kw) as s:
        assert s.get_final_message().content[0].thinking == ""
    assert final.content[1].text == m.content[1].text


def test_the_agents_sdk_reads_the_reasoning_item(svc: Service) -> None:
    """The OpenAI Agents SDK on the Responses route: a structured output (steering SmolLM2
    to think first) comes back as the SDK's ReasoningItem, then the parsed answer."""
    import asyncio

    import pydantic
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.items import MessageOutputItem, ReasoningItem

    class Colour(pydantic.BaseModel):
        colour: str = pydantic.Field(max_length=12)

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key=svc.token,
                                    max_retries=0, timeout=120)
        agent = Agent(name="painter", instructions="Answer briefly.", output_type=Colour,
                      model=OpenAIResponsesModel(model="qwen3-tmpl", openai_client=client))
        return await Runner.run(agent, "Name a colour.")

    set_tracing_disabled(True)  # (nothing is sent anywhere else)
    result = asyncio.run(run())
    items = result.new_items
    assert [type(i) for i in items] == [ReasoningItem, MessageOutputItem]
    thought = items[0].raw_item.content[0].text
    assert thought and "<think>" not in thought
    assert isinstance(result.final_output, Colour) and result.final_output.colour


def test_a_thinking_budget_bounds_the_thought(svc: Service, oai: openai.OpenAI) -> None:
    """SmolLM2 does not think on its own: without a budget it answers at once.  With one
    (llama-server's reasoning_budget_tokens; Messages' thinking.budget_tokens) the device's
    grammar opens the block, closes it within the budget, and the answer follows freely."""
    assert getattr(chat(oai, "qwen3-tmpl", max_tokens=40).choices[0].message,
                   "reasoning_content", None) is None
    tags = len(tokens(svc, "<think>\n")) + len(tokens(svc, "\n</think>\n\n"))
    for budget in (4, 12):
        r = chat(oai, "qwen3-tmpl", max_tokens=40,
                 extra_body={"reasoning_budget_tokens": budget})
        m = r.choices[0].message
        # (what follows is SmolLM2's to write: it may end at once)
        assert isinstance(getattr(m, "reasoning_content", None), str) and m.content is not None
        spent = r.usage.completion_tokens_details.reasoning_tokens
        assert 0 < spent <= budget + tags and spent <= r.usage.completion_tokens
    claude = anthropic.Anthropic(base_url=svc.url, api_key=svc.token, max_retries=0)
    msg = claude.messages.create(model="qwen3-tmpl", max_tokens=40, messages=ASK,
                                 extra_body={"temperature": 0},
                                 thinking={"type": "enabled", "budget_tokens": 4})
    assert msg.content[0].type == "thinking"  # (then a text block, unless it is empty)
    assert len(tokens(svc, msg.content[0].thinking)) <= 4 + 1  # (a token may re-split)


def tokens(svc: Service, text: str) -> list[int]:
    r = httpx.post(svc.url + "/tokenize", json={"model": "qwen3-tmpl", "content": text},
                   headers={"Authorization": f"Bearer {svc.token}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_responses_have_a_reasoning_item(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="qwen3-tmpl", input="Name a colour.", temperature=0,
                              max_output_tokens=80, reasoning={"effort": "low"},
                              text={"format": {"type": "json_schema", "name": "colour",
                                               "schema": SCHEMA}})
    r = oai.responses.create(**kw)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], kinds
    thought = r.output[0].content[0].text  # the SDK's ResponseReasoningItem
    assert thought and r.output[0].status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    # streamed: the reasoning_text deltas, then the message's, in the same items
    deltas: dict[str, str] = {"response.reasoning_text.delta": "",
                              "response.output_text.delta": ""}
    final = None
    for ev in oai.responses.create(stream=True, **kw):
        if ev.type in deltas:
            deltas[ev.type] += ev.delta
        if ev.type == "response.completed":
            final = ev.response
    assert deltas == {"response.reasoning_text.delta": thought,
                      "response.output_text.delta": r.output_text}
    assert final is not None and [i.type for i in final.output] == kinds
    # the items sent back as the next input (as the Agents SDK does): reasoning included
    again = oai.responses.create(model="qwen3-tmpl", max_output_tokens=8, temperature=0,
                                 input=[{"role": "user", "content": "Name a colour."},
                                        *[i.model_dump(exclude_none=True) for i in r.output],
                                        {"role": "user", "content": "Another."}])
    assert again.status in ("completed", "incomplete")
