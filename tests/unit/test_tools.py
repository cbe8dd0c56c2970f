"""Tools without a model: the request fields' checks, the fallback prompt format, the
grammar (compiled over the byte-level vocabulary of test_grammar.py) and the parsing of
answers, whole and streamed."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from aotx.engine.grammar import GrammarCompiler, GrammarError, GrammarSpec
from aotx.gateway import tools
from aotx.gateway.requests import ChatRequest
from aotx.wire import ToolFormat

from .test_grammar import compiler, tok  # noqa: F401 - the fixture

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
ID = bytes(16)  # a request's identity
FB = ToolFormat.FALLBACK


def request(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], **fields})


def accepts(c: GrammarCompiler, body: ChatRequest, text: str) -> bool:
    assert body.constraint(FB) is not None
    m = c.matcher(GrammarSpec.lark(body.constraint(FB).text))
    return all(m.consume(t) for t in tok(text)) and m.can_stop


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.mark.parametrize("fields, wrong", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "is not 1-64"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "is not 1-64"),
    ({"tools": [CLOCK, CLOCK]}, "duplicate"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "object schema"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [CLOCK], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "deprecated"),
    # response_format: nothing it does not know is passed over
    ({"response_format": {}}, "type must be"),
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}},
     r"response_format.schema is not a field of a json_object .*json_schema.schema"),
    ({"response_format": {"type": "text", "foo": 1}}, "response_format.foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {}, "strcit": True}}}, "response_format.json_schema.strcit"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {}, "strict": "yes"}}}, "strict is true or false"),
    ({"tools": [{"type": "retrieval"}]}, "function"),
])
def test_bad_tools_are_refused(fields: dict[str, Any], wrong: str) -> None:
    with pytest.raises(ValidationError, match=wrong):
        request(**fields)


def test_the_response_formats_that_are_read() -> None:
    assert request(response_format={"type": "text"}).constraint(FB) is None
    assert request(response_format={"type": "json_object"}).constraint(FB) is not None
    assert request(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}, "strict": True,
        "description": "d"}}).constraint(FB) is not None


def test_modes_and_the_prompt() -> None:
    assert request(tools=[CLOCK]).tool_mode == "auto"
    assert request(tools=[CLOCK], tool_choice="none").tool_mode is None
    assert request(tools=[CLOCK], tool_choice="none").constraint(FB) is None
    assert request(tools=[CLOCK], tool_choice="required").tool_mode == "required"
    body = ChatRequest.model_validate({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text",
                                                                "text": "rain"}]}]})
    env = body.envelope(FB)
    assert [m.role for m in env] == ["system", "user", "assistant", "user"]
    assert env[0].text().startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in env[0].text()
    assert env[2].text() == (call("get_weather", '{"city": "Paris"}') + "\n"
                             + call("get_weather", '{"city": "Rome"}'))
    assert env[3].text() == ("<tool_response>\nsunny\n</tool_response>\n"
                             "<tool_response>\nrain\n</tool_response>")
    assert request(tools=[CLOCK]).envelope(FB)[0].role == "system"
    with pytest.raises(ValidationError, match="tool_call_id"):
        ChatRequest.model_validate({"model": "m", "messages": [
            {"role": "tool", "content": "x"}]})


def test_the_grammar(compiler: GrammarCompiler) -> None:  # noqa: F811
    auto = request(tools=[WEATHER, CLOCK])
    assert accepts(compiler, auto, "Hello there")
    assert accepts(compiler, auto, call("now", "{}"))
    assert accepts(compiler, auto, call("get_weather", '{"city": "Oslo"}'))
    assert not accepts(compiler, auto, call("get_weather", '{"town": "Oslo"}'))
    assert not accepts(compiler, auto, call("now", '{"x": 1}'))
    assert accepts(compiler, auto, "Sure!\n" + call("now", "{}"))
    assert accepts(compiler, auto, "a < b <tool_ca" + call("now", "{}"))
    assert not accepts(compiler, auto, "x <tool_call> y")
    assert not accepts(compiler, auto, call("now", "{}") + " and text after")
    required = request(tools=[WEATHER, CLOCK], tool_choice="required")
    assert not accepts(compiler, required, "Hello")
    assert not accepts(compiler, required, "Hello " + call("now", "{}"))
    two = call("now", "{}") + "\n" + call("get_weather", '{"city": "Oslo"}')
    assert accepts(compiler, required, two)
    single = request(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert not accepts(compiler, single, two)
    named = request(tools=[WEATHER, CLOCK], tool_choice={"type": "function",
                                                          "function": {"name": "now"}})
    assert accepts(compiler, named, call("now", "{}"))
    assert not accepts(compiler, named, call("get_weather", '{"city": "Oslo"}'))
    assert named.tool_names == ("now",)
    bad = request(tools=[CLOCK, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "maxlength": 2}}}}}])
    with pytest.raises(GrammarError) as info:
        GrammarSpec.lark(bad.constraint(FB).text)  # type: ignore[union-attr]
    assert info.value.where == "%json[1]#/properties/a"
    assert bad.tool_names == ("now", "f")


def test_answers_whole_and_streamed() -> None:
    text = call("get_weather", '{"city": "Oslo"}') + "\n" + call("now", "{}")
    msg, finish = tools.message(text, "stop", "required", ID, FB)
    assert finish == "tool_calls" and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "now"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert [c["id"] for c in msg["tool_calls"]] == [tools.call_id(ID, 0), tools.call_id(ID, 1)]
    assert tools.call_id(ID, 0) != tools.call_id(b"\1" * 16, 0)
    assert re.fullmatch(r"call_[0-9a-f]{24}", tools.call_id(ID, 0))
    assert tools.message("Hello", "stop", "auto", ID, FB) == ({"role": "assistant",
                                                        "content": "Hello"}, "stop")
    assert tools.message(text, "stop", None, ID, FB)[0]["content"] == text
    s = tools.ToolStream("auto", ID, FB)
    assert [s.feed(t) for t in ["<to", "ol_call>\n{", text[13:]]] == ["", "", ""]
    content, deltas, finish = s.end("stop")
    assert (content, finish) == ("", "tool_calls")
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                   if d["tool_calls"][0]["index"] == 0)
    assert json.loads(args) == {"city": "Oslo"}
    s = tools.ToolStream("auto", ID, FB)
    assert [s.feed(t) for t in ["<t", "ab", "le>"]] == ["", "<tab", "le>"]
    assert s.end("stop") == ("", [], "stop")


def test_text_before_calls_whole_and_streamed() -> None:
    text = "Let me look.\n" + call("now", "{}")
    msg, finish = tools.message(text, "stop", "auto", ID, FB)
    assert (msg["content"], finish) == ("Let me look.", "tool_calls")
    assert msg["tool_calls"][0]["function"]["name"] == "now"
    s = tools.ToolStream("auto", ID, FB)
    sent = [s.feed(t) for t in ["Let me", " look.\n", "<tool", "_call>\n{", text[26:]]]
    assert sent == ["Let me", " look.", "", "", ""]
    content, deltas, finish = s.end("stop")
    assert (content, finish) == ("", "tool_calls") and len(deltas) == 2
    # a call cut short (max_tokens) is all content, whitespace included, as unstreamed
    s = tools.ToolStream("auto", ID, FB)
    cut = "Hm.\n<tool_call>\n{\"name\""
    assert s.feed(cut) + s.end("length")[0] == tools.message(cut, "length", "auto", ID, FB)[0][
        "content"] == cut


def test_fields_aotx_does_not_implement_are_refused_by_name() -> None:
    for field, value in [("prediction", {"type": "content", "content": "x"}),
                         ("reasoning_effort", "extreme"), ("metadata", {"a": "b"}),
                         ("audio", {"voice": "alloy"}), ("store", True),
                         ("modalities", ["text", "audio"]), ("service_tier", "flex")]:
        with pytest.raises(ValidationError) as info:
            request(**{field: value})
        assert info.value.errors()[0]["loc"][0] == field, field
    with pytest.raises(ValidationError, match="stream_options"):
        request(stream_options={"include_usage": True, "include_obfuscation": False})
    ok = request(user="u1", safety_identifier="s", service_tier="auto", modalities=["text"],
                 store=False)
    assert ok.user == "u1"


def test_an_answer_message_from_the_sdk_can_be_sent_back() -> None:
    echoed = {"role": "assistant", "content": "Hi!", "refusal": None, "annotations": [],
              "audio": None, "function_call": None, "tool_calls": None}
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "again"}]})
    assert body.messages[1].text() == "Hi!"
    refused = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "assistant", "content": None, "refusal": "I can't."}]})
    assert refused.messages[0].text() == "I can't."
    for bad in ({"audio": {"id": "a"}}, {"annotations": [{"type": "url_citation"}]},
                {"colour": "red"}):
        with pytest.raises(ValidationError):
            ChatRequest.model_validate({"model": "m", "messages": [
                {"role": "assistant", "content": "x", **bad}]})


# -- a template that renders tools: Llama 3's format, and the submission's fields ------------
L3 = ToolFormat.LLAMA3


def l3call(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


def accepts_in(c: GrammarCompiler, body: ChatRequest, fmt: ToolFormat, text: str) -> bool:
    constraint = body.constraint(fmt)
    assert constraint is not None
    m = c.matcher(GrammarSpec.lark(constraint.text))
    return all(m.consume(t) for t in tok(text)) and m.can_stop


def test_the_llama3_grammar(compiler: GrammarCompiler) -> None:  # noqa: F811
    auto = request(tools=[WEATHER, CLOCK])
    assert accepts_in(compiler, auto, L3, "Hello there")
    assert accepts_in(compiler, auto, L3, l3call("get_weather", '{"city": "Oslo"}'))
    assert accepts_in(compiler, auto, L3, l3call("now", "{}"))
    assert not accepts_in(compiler, auto, L3, l3call("now", '{"x": 1}'))
    assert not accepts_in(compiler, auto, L3, '{"other": 1}')  # "{" begins a call
    assert not accepts_in(compiler, auto, L3, " " + l3call("now", '{"x": 1}'))
    assert accepts_in(compiler, auto, L3, call("now", "{}"))  # Hermes markup is text here
    assert not accepts_in(compiler, auto, L3, l3call("now", "{}") + "\n" + l3call("now", "{}"))
    required = request(tools=[WEATHER, CLOCK], tool_choice="required")
    assert not accepts_in(compiler, required, L3, "Hello")
    assert accepts_in(compiler, required, L3, l3call("now", "{}"))
    named = request(tools=[WEATHER, CLOCK], tool_choice={"type": "function",
                                                          "function": {"name": "now"}})
    assert not accepts_in(compiler, named, L3, l3call("get_weather", '{"city": "Oslo"}'))
    # the same request in the Hermes format takes Hermes calls only
    assert not accepts_in(compiler, required, ToolFormat.HERMES, l3call("now", "{}"))
    assert accepts_in(compiler, required, ToolFormat.HERMES, call("now", "{}"))


def test_llama3_answers_whole_and_streamed() -> None:
    text = l3call("get_weather", '{"city": "Oslo"}')
    msg, finish = tools.message(text, "stop", "auto", ID, L3)
    assert (msg["content"], finish) == (None, "tool_calls")
    assert msg["tool_calls"] == [{"id": tools.call_id(ID, 0), "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert tools.message("Hi {x}", "stop", "auto", ID, L3)[0] == {"role": "assistant",
                                                                  "content": "Hi {x}"}
    s = tools.ToolStream("auto", ID, L3)
    assert [s.feed(t) for t in ["", "{\"na", text[4:]]] == ["", "", ""]
    content, deltas, finish = s.end("stop")
    assert (content, finish, len(deltas)) == ("", "tool_calls", 2)
    s = tools.ToolStream("auto", ID, L3)
    assert [s.feed(t) for t in ["It is", " {warm}"]] == ["It is", " {warm}"]
    assert s.end("stop") == ("", [], "stop")
    # the grammar lets no text begin with white space and then "{": neither does the parser
    assert tools.message(" " + text, "stop", "auto", ID, L3)[0]["content"] == " " + text
    assert tools.message('{"name": "f", "arguments": {}}', "stop", "auto", ID, L3)[1] == "stop"
    cut = '{"name": "now", "param'  # max_tokens cut the call: all content
    s = tools.ToolStream("required", ID, L3)
    assert s.feed(cut) == "" and s.end("length") == (cut, [], "length")


# -- gpt-oss's harmony: a call in the commentary channel ------------------------------------
HM = ToolFormat.HARMONY


def hmcall(name: str, args: str) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}"


def test_the_harmony_grammar(compiler: GrammarCompiler) -> None:  # noqa: F811
    """What follows ``<|start|>assistant<|channel|>`` after the thinking (the device puts
    the analysis channel before it: test_grammar)."""
    def after(text: str) -> str:  # (the answer as the grammar sees it: from the channel)
        return text.removeprefix("<|channel|>")

    auto = request(tools=[WEATHER, CLOCK])
    assert accepts_in(compiler, auto, HM, "final<|message|>Hello there")
    assert accepts_in(compiler, auto, HM, after(hmcall("get_weather", '{"city": "Oslo"}')))
    assert not accepts_in(compiler, auto, HM, after(hmcall("now", '{"x": 1}')))
    assert not accepts_in(compiler, auto, HM, "Hello")  # no channel: not gpt-oss's answer
    assert not accepts_in(compiler, auto, HM, "analysis<|message|>Hm")
    required = request(tools=[WEATHER, CLOCK], tool_choice="required")
    assert not accepts_in(compiler, required, HM, "final<|message|>Hello")
    assert accepts_in(compiler, required, HM, after(hmcall("now", "{}")))
    assert not accepts_in(compiler, required, HM, after(hmcall("now", "{}")) + hmcall("now", "{}"))


def test_harmony_answers_whole_and_streamed() -> None:
    text = hmcall("get_weather", '{"city": "Oslo"}')
    for whole in (text, text + "<|call|>"):  # (the call's end shows where text has it)
        msg, finish = tools.message(whole, "stop", "auto", ID, HM)
        assert (msg["content"], finish) == (None, "tool_calls")
        assert msg["tool_calls"] == [{"id": tools.call_id(ID, 0), "type": "function",
                                      "function": {"name": "get_weather",
                                                   "arguments": '{"city": "Oslo"}'}}]
    assert tools.message("Hi", "stop", "auto", ID, HM)[0] == {"role": "assistant",
                                                              "content": "Hi"}
    s = tools.ToolStream("auto", ID, HM)
    assert [s.feed(t) for t in ["<|chan", "nel|>comm", text[15:]]] == ["", "", ""]
    content, deltas, finish = s.end("stop")
    assert (content, finish, len(deltas)) == ("", "tool_calls", 2)
    s = tools.ToolStream("auto", ID, HM)  # (the final channel's markup went with the
    assert [s.feed(t) for t in ["<|", "It is", " warm"]] == ["", "<|It is", " warm"]  # split)
    cut = hmcall("now", '{"a')  # max_tokens cut the call: all content
    s = tools.ToolStream("required", ID, HM)
    assert s.feed(cut) == "" and s.end("length") == (cut, [], "length")


def test_a_template_that_renders_tools_gets_them_as_fields() -> None:
    body = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "rain"}])
    assert body.envelope(ToolFormat.HERMES) == body.messages  # as they came
    assert [m.role for m in body.envelope(FB)] == ["system", "user", "assistant", "user"]
    assert json.loads(body.template_tools()) == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER["function"]["parameters"]}}]
    assert tools.template_calls(body.messages[1].tool_calls or []) == [
        {"id": "call_9", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert request(tools=[WEATHER], tool_choice="none").template_tools() == ""
