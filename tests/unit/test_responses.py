"""The Responses mapping without a model: ids, the body onto the chat envelope, the
response object, the stream's events as a function of the output bytes (however they
arrive), and the stored rows' access and retention."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from pydantic import ValidationError

from aotx import ids, wire
from aotx.gateway import tools as T
from aotx.gateway.errors import ApiError
from aotx.gateway.response_events import MAX_PIECE, Events, Splitter, boundary
from aotx.gateway.response_store import ResponseStore
from aotx.gateway.responses import (
    ResponseRequest,
    input_item_ids,
    messages_of,
    output_items,
    parse_response_id,
    response_id,
    response_object,
)
from aotx.wire import ToolFormat

IDENT = bytes(range(16))
FB = ToolFormat.FALLBACK


def header(phase: wire.Phase = wire.Phase.COMPLETED, finish: wire.Finish = wire.Finish.STOP,
           tools: bool = False, **kw: Any) -> wire.Header:
    return wire.Header(op=wire.Op.READ, epoch=3, identity=IDENT, phase=phase, finish=finish,
                       flags=wire.SUBMIT_FLAG_TOOLS if tools else 0, **kw)


def test_response_ids_map_one_to_one_onto_request_ids() -> None:
    rid = response_id(3, IDENT)
    assert rid == "resp_0000000000000003" + IDENT.hex() and len(rid) == 53
    assert parse_response_id(rid) == (3, IDENT) == ids.parse_request_id(
        ids.format_request_id(3, IDENT))
    for bad in ("resp_" + "0" * 47, rid.upper(), "req-" + rid[4:], rid + "0", rid[:-1] + "g"):
        with pytest.raises(ApiError) as err:
            parse_response_id(bad, "previous_response_id")
        assert err.value.status == 404 and err.value.param == "previous_response_id"


def test_the_body_becomes_the_chat_envelope() -> None:
    body = ResponseRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look: "},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            {"type": "input_image", "digest": "sha256:" + "ab" * 32}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"}]})
    chat = body.chat([{"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "earlier"}]}])
    assert [m.role for m in chat.messages] == ["system", "assistant", "user", "assistant",
                                               "tool"]
    assert chat.messages[0].content == "Be brief." and chat.messages[1].content == "earlier"
    kinds = [type(p).__name__ for p in chat.messages[2].parts()]
    assert kinds == ["TextPart", "ImageUrlPart", "MediaPart"]
    assert chat.messages[3].tool_calls and chat.messages[3].tool_calls[0].id == "c1"
    assert chat.messages[4].tool_call_id == "c1" and chat.token_limit == 9
    assert chat.tool_mode == "required" and chat.parallel_tool_calls is False
    assert chat.constraint(FB) is not None and chat.constraint(FB).kind is wire.GrammarKind.LARK


def test_a_function_call_joins_the_assistant_text_before_it() -> None:
    msgs = messages_of([{"type": "message", "role": "assistant", "content": "Let me see."},
                        {"type": "function_call", "call_id": "a", "name": "f",
                         "arguments": "{}"},
                        {"type": "function_call", "call_id": "b", "name": "g",
                         "arguments": "{}"}])
    assert len(msgs) == 1 and [c["id"] for c in msgs[0]["tool_calls"]] == ["a", "b"]


def test_text_format_is_chats_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ResponseRequest.model_validate({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "s", "schema": schema, "strict": True}}})
    c = body.chat([]).constraint(FB)
    assert c is not None and c.kind is wire.GrammarKind.JSON_SCHEMA
    assert c.text == ('{"type":"object","properties":{"a":{"type":"integer"}},'
                      '"additionalProperties":false}')  # closed: gateway/closed_objects.py
    with pytest.raises(ApiError) as err:
        ResponseRequest.model_validate({"model": "m", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "no spaces", "schema": schema}}}).chat([])
    assert err.value.status == 400 and "text.format" in err.value.message


@pytest.mark.parametrize("extra", [{"reasoning": {"effort": "extreme"}}, {"truncation": "auto"},
                                   {"include": ["x"]}, {"text": {"verbosity": "low"}},
                                   {"tools": [{"type": "web_search"}]},
                                   {"input": [{"type": "item_reference", "id": "x"}]},
                                   {"input": [{"role": "user", "content": [
                                       {"type": "input_image", "file_id": "f"}]}]},
                                   {"background": True, "store": False}, {"input": []}])
def test_what_is_not_served_is_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ResponseRequest.model_validate({"model": "m", "input": "x", **extra})


def test_tool_checks_are_chats_and_name_this_bodys_fields() -> None:
    body = ResponseRequest.model_validate({"model": "m", "input": "x", "tool_choice": "required"})
    with pytest.raises(ApiError) as err:
        body.chat([])
    assert "tool_choice needs tools" in err.value.message


def test_the_response_object_follows_the_device_state() -> None:
    done = response_object(header(), b"Hi there", "smollm2", None, 5.0)
    assert done["status"] == "completed" and done["model"] == "smollm2"
    assert done["output"][0]["content"][0]["text"] == "Hi there"
    cut = response_object(header(finish=wire.Finish.LENGTH), b"Hi", "m", None, 5.0)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    queued = response_object(header(wire.Phase.QUEUED, wire.Finish.NONE), b"", "m", None, 5.0)
    assert queued["status"] == "queued" and queued["output"] == []
    failed = response_object(header(wire.Phase.FAILED, wire.Finish.NONE, failure=503,
                                     reason=wire.Reason.KV_FULL), b"", "m", None, 5.0)
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    stopped = response_object(header(wire.Phase.CANCELLED, wire.Finish.NONE), b"ab", "m", None, 1)
    assert stopped["status"] == "cancelled"


CALLS = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def test_tool_output_is_a_message_and_function_calls() -> None:
    items = output_items(header(tools=True), CALLS.encode())
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Sure."
    assert items[1]["call_id"] == T.call_id(IDENT, 0) and items[1]["arguments"] == '{"a": 1}'
    assert items[1]["id"] == "fc_" + items[1]["call_id"][5:]


def test_gpt_oss_thinks_then_calls() -> None:
    """The analysis channel's thinking is done where the call's commentary channel opens,
    as the stream says (response_events)."""
    flags = (wire.SUBMIT_FLAG_TOOLS | wire.ToolFormat.HARMONY << wire.SUBMIT_TOOL_FORMAT_SHIFT
             | wire.STATE_FLAG_THINKS | wire.STATE_FLAG_CHANNELS)
    data = (b"<|channel|>analysis<|message|>Hm.<|start|>assistant<|channel|>commentary "
            b'to=functions.f <|constrain|>json<|message|>{"a": 1}')
    h = header(wire.Phase.RUNNING, wire.Finish.NONE)._replace(flags=flags)
    items = output_items(h, data)
    assert [(i["type"], i["status"]) for i in items] == [("reasoning", "completed"),
                                                           ("function_call", "completed")]
    assert items[0]["content"][0]["text"] == "Hm." and items[1]["arguments"] == '{"a": 1}'


def run(data: bytes, chunks: list[int], last: wire.Header) -> list[dict[str, Any]]:
    """The events of output ``data`` arriving in runs of the given sizes."""
    def snap(h: wire.Header, d: bytes, s: str | None) -> dict[str, Any]:
        return response_object(h, d, "m", None, 1.0, s)
    first = last._replace(phase=wire.Phase.QUEUED, finish=0)
    ev = Events(first, snap)
    out = ev.start(first)
    at = 0
    for n in chunks:
        out += ev.feed(data[at:at + n])
        at += n
    out += ev.feed(data[at:])
    return out + ev.end(last)


def random_chunks(rng: random.Random, size: int) -> list[int]:
    out = []
    while sum(out) < size:
        out.append(rng.randint(0, 9))
    return out


@pytest.mark.parametrize("text,tools", [
    ("Hello, wörld! 你好世界 " * 9 + "x" * 150 + " end\n\n  trailing  ", False),
    ("", False), ("   ", False), (CALLS, True), ("plain text, no call", True),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', True)])
def test_events_depend_on_the_bytes_not_on_how_they_arrived(text: str, tools: bool) -> None:
    data = text.encode()
    last = header(tools=tools)
    once = run(data, [len(data)], last)
    rng = random.Random(7)
    for _ in range(30):
        assert run(data, random_chunks(rng, len(data)), last) == once
    assert [e["sequence_number"] for e in once] == list(range(len(once)))
    final = once[-1]["response"]
    assert once[-1]["type"] == "response.completed"
    assert final["output"] == output_items(last, data)
    deltas = "".join(e["delta"] for e in once if e["type"] == "response.output_text.delta")
    msgs = [i for i in final["output"] if i["type"] == "message"]
    assert deltas == (msgs[0]["content"][0]["text"] if msgs else "")
    assert all(len(e["delta"].encode()) <= MAX_PIECE for e in once
               if e["type"] == "response.output_text.delta" and not tools)


def test_pieces_cut_after_white_space_and_at_character_starts() -> None:
    assert boundary(b"Hello, world") == 7 and boundary(b"Hello,") is None
    s = Splitter()
    assert s.feed("é".encode() * 40) == ["é".encode() * 32]  # 64 bytes, never mid-character
    assert boundary(b"a" * MAX_PIECE) is None  # the cut needs the byte after it


def test_terminal_events_name_how_it_ended() -> None:
    kinds = {p: run(b"abc", [], header(p, f))[-1]["type"] for p, f in (
        (wire.Phase.COMPLETED, wire.Finish.LENGTH), (wire.Phase.CANCELLED, wire.Finish.NONE),
        (wire.Phase.FAILED, wire.Finish.NONE))}
    assert kinds == {wire.Phase.COMPLETED: "response.incomplete",
                     wire.Phase.CANCELLED: "response.incomplete",
                     wire.Phase.FAILED: "response.failed"}


def test_input_items_have_stable_ids() -> None:
    items = [{"type": "message", "role": "user", "content": "hi", "id": "mine"},
             {"type": "function_call_output", "call_id": "c", "output": "1"}]
    listed = input_item_ids(IDENT, items)
    assert listed == input_item_ids(IDENT, items)
    assert listed[0]["id"].startswith("msg_") and listed[0]["id"] != "mine"
    assert listed[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert listed[1]["id"].startswith("fco_")


def test_stored_rows_are_per_principal_and_follow_retention(tmp_path: Any) -> None:
    st = ResponseStore(str(tmp_path))
    st.put(7, 2, IDENT, time.time() - 1000, {"x": 1}, [{"a": 1}], [])
    assert st.get(8, 2, IDENT) is None  # another principal's: nothing
    got = st.get(7, 2, IDENT)
    assert got is not None and got.echo == {"x": 1} and got.input == [{"a": 1}]
    st.put(7, 1, b"\2" * 16, time.time(), {}, [], [])
    assert st.due(2, 900) == [(7, 2, IDENT)]  # old enough to ask the device
    assert st.get(7, 1, b"\2" * 16) is None  # an ended epoch's row went
    st.checked(2, IDENT, gone=False)
    assert st.due(2, 900) == []  # asked lately
    st.delete(7, 2, IDENT)
    assert st.deleted(7, 2, IDENT) and not st.deleted(8, 2, IDENT)
    st.close()
    reopened = ResponseStore(str(tmp_path))  # a tombstone survives a restart
    assert reopened.deleted(7, 2, IDENT)
    assert oct((tmp_path / "responses.db").stat().st_mode & 0o777) == "0o600"
    reopened.close()


def test_epochs_of_every_device_id_are_stored_and_found(tmp_path: Any) -> None:
    """An epoch is 64 bits (device id << 48): device ids from 0x8000 give epochs of 2^63
    and more, which SQLite's signed integers hold as the same bits; an id naming any
    such epoch is looked up (none there: None), never an OverflowError (issue 39)."""
    st = ResponseStore(str(tmp_path))
    high, top = ids.make_epoch(0x8000, 1), (1 << 64) - 1
    for epoch in (high, top, 1 << 63, (1 << 63) - 1):
        assert st.get(7, epoch, IDENT) is None and not st.deleted(7, epoch, IDENT)
    st.put(7, high, IDENT, time.time() - 1000, {"x": 1}, [], [])
    got = st.get(7, high, IDENT)
    assert got is not None and got.echo == {"x": 1}
    assert st.get(7, high - (1 << 63), IDENT) is None  # not its low bits' epoch
    assert st.due(high, 900) == [(7, high, IDENT)]  # back as the unsigned epoch
    st.delete(7, top, IDENT)
    assert st.deleted(7, top, IDENT)
    st.close()
