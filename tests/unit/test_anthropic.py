"""Anthropic's Messages body as a chat request, the answer's stop_reason and blocks, and
the error envelope (gateway/anthropic.py): one layer, without a device.  The route
end to end: tests/e2e/test_e2e_messages.py."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from aotx.gateway import anthropic as A
from aotx.gateway.errors import ApiError


def body(**kw: Any) -> A.MessagesRequest:
    return A.MessagesRequest.model_validate({"model": "m", "max_tokens": 10, **kw})


def test_a_conversation_with_tools_becomes_chat_messages() -> None:
    chat = body(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B",
                                                          "cache_control": {"type": "ephemeral"}}],
                messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "thanks"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "down"}]}]}],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"]).chat_request(0)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert got[0] == {"role": "system", "content": "A\n\nB"}
    assert got[1] == {"role": "user", "content": [{"type": "text", "text": "weather?"}]}
    assert got[2]["content"] == "Let me look."  # the thinking block is not rendered
    assert got[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"city": "Paris"}'}
    # the turn's tool results first, then its text
    assert got[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"}
    assert got[4]["role"] == "user" and got[4]["content"][0]["text"] == "thanks"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.max_tokens == 10


@pytest.mark.parametrize(("choice", "chat"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}})])
def test_tool_choice(choice: dict[str, Any], chat: Any) -> None:
    got = body(messages=[{"role": "user", "content": "x"}], tool_choice=choice,
               tools=[{"name": "w", "input_schema": {"type": "object"}}]).chat_request(0)
    dumped = got.model_dump(exclude_none=True)["tool_choice"]
    assert dumped == chat


def test_max_tokens_is_a_ceiling_held_to_the_callers_cap() -> None:
    b = body(max_tokens=32000, messages=[{"role": "user", "content": "x"}])
    assert b.chat_request(8192).max_tokens == 8192
    assert b.chat_request(0).max_tokens == 32000  # (no cap known: the device's check)


@pytest.mark.parametrize(("kw", "param"), [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages"),  # prefill
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "w", "input": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, None),
])
def test_refusals_name_this_bodys_field(kw: dict[str, Any], param: str | None) -> None:
    with pytest.raises(ApiError) as err:
        body(**kw).chat_request(0)
    assert err.value.status == 400 and err.value.param == param


def test_stop_reason_and_blocks() -> None:
    assert A.stop_reason("stop", 2, ["a", "b"]) == ("stop_sequence", "b")
    assert A.stop_reason("stop", 0, ["a"]) == ("end_turn", None)
    assert A.stop_reason("length", 0, None) == ("max_tokens", None)
    assert A.stop_reason("tool_calls", 0, None) == ("tool_use", None)
    call = {"id": "c", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}
    assert A.content({"content": None, "tool_calls": [call]}) == [
        {"type": "tool_use", "id": "c", "name": "w", "input": {"a": 1}}]
    assert A.content({"content": ""}) == []


def test_an_error_answer_goes_out_in_anthropics_envelope() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def answer(status: int, payload: bytes) -> None:
        out = A.enveloped(send)
        await out({"type": "http.response.start", "status": status,
                   "headers": [(b"content-length", str(len(payload)).encode())]})
        await out({"type": "http.response.body", "body": payload[:5], "more_body": True})
        await out({"type": "http.response.body", "body": payload[5:]})

    standard = orjson.dumps({"error": {"message": "too big", "type": "invalid_request_error",
                                       "code": "x", "param": None}})
    asyncio.run(answer(413, standard))
    doc = orjson.loads(sent[1]["body"])
    assert doc == {"type": "error", "error": {"type": "request_too_large", "message": "too big"}}
    assert sent[0]["headers"] == [(b"content-length", str(len(sent[1]["body"])).encode())]
    sent.clear()
    asyncio.run(answer(503, standard))
    assert orjson.loads(sent[1]["body"])["error"]["type"] == "overloaded_error"
