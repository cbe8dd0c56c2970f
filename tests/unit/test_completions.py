"""``POST /v1/completions`` without a model: the body's forms and refusals, the raw
submissions it becomes, the legacy logprobs cut from annotation lines (``Cutter``), and
the route in process over a scripted broker (what it sends, how it answers)."""

from __future__ import annotations

import json
import struct
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from aotx import wire
from aotx.gateway.completions import MAX_PROMPTS, CompletionRequest, Cutter, submission
from aotx.gateway.credentials import PrincipalGrant
from aotx.gateway.errors import ApiError
from aotx.gateway.service import Principal

from .test_gateway_http import EPOCH, INFO, ScriptedBroker, error, gw  # noqa: F401

MODEL = INFO.models[0]
ME = Principal(1, "me", PrincipalGrant(1, "me", int(wire.Action.all()), ("*",)))


def body(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "smollm2", "prompt": "hi", **kw})


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([5, 0, 7], [[5, 0, 7]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_a_prompt_is_a_string_strings_token_ids_or_arrays_of_them(
        prompt: Any, prompts: list[Any]) -> None:
    assert body(prompt=prompt).prompts == prompts


@pytest.mark.parametrize("prompt", [
    "", [], [""], [[]], ["a", [5]], [5, "a"], [-1], [[5], [1 << 31]], [True], [1.0],
    {"text": "a"}, 5, ["a"] * (MAX_PROMPTS + 1), "\ud800",
])
def test_bad_prompts_are_refused_as_prompt(prompt: Any) -> None:
    with pytest.raises(ValidationError) as err:
        body(prompt=prompt)
    assert [e["loc"] for e in err.value.errors()] == [("prompt",)]


@pytest.mark.parametrize("kw, field", [
    ({"suffix": "end"}, "suffix"), ({"suffix": 5}, "suffix"),
    ({"best_of": 2}, "best_of"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"logprobs": 6}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"messages": []}, "messages"),
    ({"stop": [""]}, "stop"), ({"stop": ["\udc00"]}, "stop"), ({"stop": 5}, "stop"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 9}, "n"), ({"user": "u" * 257}, "user"), ({"temperature": 2.5}, "temperature"),
])
def test_refused_fields_are_named(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        body(**kw)
    assert err.value.errors()[0]["loc"] == (field,)


def test_accepted_values_of_the_fields_refused_otherwise() -> None:
    assert body(suffix="", best_of=1, user="me").suffix == ""
    assert body(n=3, best_of=3).best_of == 3


@pytest.mark.parametrize("kw, param", [
    ({"echo": True, "logprobs": 0}, "echo"),
    ({"echo": True, "prompt": [5, 6]}, "echo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["a"] * 9, "n": 8}, "n"),  # 72 device requests
])
def test_checks_across_fields_name_the_field_at_fault(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        body(**kw).check()
    assert (err.value.status, err.value.param) == (400, param)


def test_the_same_fields_pass_the_checks_alone() -> None:
    for kw in ({"echo": True}, {"logprobs": 0}, {"prompt": [5, 6]},
               {"stream": True, "stream_options": {"include_usage": True}},
               {"prompt": ["a"] * 8, "n": 8}):
        body(**kw).check()


def test_a_text_prompt_becomes_a_raw_submission() -> None:
    b = body(prompt="<|im_start|>hi", stop="x", logprobs=2, presence_penalty=0.5,
             temperature=0.25, logit_bias={"7": 3})
    h, payload, call = submission(b, b.prompts[0], 0, MODEL, ME)
    assert h.submit_flags == wire.SUBMIT_FLAG_RAW and h.seed == 0
    assert (h.max_tokens, h.temperature, h.top_p, h.role) == (16, 0.25, 1.0, MODEL.role)
    wire.check_request(h)
    sub = wire.decode_submission(payload)
    assert sub.messages == (wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.TEXT, b"<|im_start|>hi"),)),)
    assert sub.stop == ("x",)
    assert (sub.sampling.logprobs, sub.sampling.presence, sub.sampling.bias) == (
        3, 0.5, ((7, 3.0),))  # logprobs k is k + 1 on the wire
    assert (call.model, call.max_tokens, call.input_bytes) == ("smollm2", 16, len(payload))


def test_token_ids_travel_as_a_token_part_and_choices_shift_the_seed() -> None:
    b = body(prompt=[[5, 49151]], seed=2**64 - 1, max_tokens=3)
    h, payload, _ = submission(b, b.prompts[0], 2, MODEL, ME)
    assert h.submit_flags == wire.SUBMIT_FLAG_RAW | wire.SUBMIT_FLAG_SEED
    assert h.seed == 2 and h.max_tokens == 3  # 2^64 - 1 folds to 0, then + 2
    part = wire.decode_submission(payload).messages[0].parts[0]
    assert part == wire.Part(wire.PartKind.TOKENS, struct.pack("<2I", 5, 49151))


def test_a_prompt_over_one_packet_is_413_naming_the_prompt() -> None:
    b = body(prompt="x" * wire.MAX_PAYLOAD)
    with pytest.raises(ApiError) as err:
        submission(b, b.prompts[0], 0, MODEL, ME)
    assert (err.value.status, err.value.param) == (413, "prompt")


def note(offset: int, raw: bytes, logprob: float = -0.5,
         top: list[tuple[bytes, float]] | None = None) -> dict[str, Any]:
    return {"offset": offset, "token": 1, "logprob": logprob, "bytes": list(raw),
            "top": [[2, lp, list(b)] for b, lp in (top or [])]}


def test_cut_pieces_end_where_tokens_end() -> None:
    cut = Cutter(2)
    # "Hi" + " there": two tokens; the bytes of a third arrive before its line
    text, lp = cut.add(b"Hi there!", [note(0, b"Hi", -0.1, [(b"Hi", -0.1), (b"Ho", -2.0)]),
                                      note(2, b" there", -0.3)]) or ("", {})
    assert text == "Hi there"
    assert lp == {"tokens": ["Hi", " there"], "token_logprobs": [-0.1, -0.3],
                  "top_logprobs": [{"Hi": -0.1, "Ho": -2.0}, {" there": -0.3}],
                  "text_offset": [0, 2]}
    assert cut.add(b"", []) is None  # "!" has no line yet
    text, lp = cut.add(b"", [note(8, b"!")]) or ("", {})
    assert (text, lp["tokens"], lp["text_offset"]) == ("!", ["!"], [8])


def test_a_character_belongs_to_the_token_that_completes_it() -> None:
    """'é' (c3 a9) split over two tokens, then a token holding the end of '€' (e2 82 ac)
    and a letter: strings joined are the text, offsets count characters."""
    cut = Cutter(0)
    data = "aé€b".encode()  # 61 c3 a9 e2 82 ac 62
    notes = [note(0, b"a\xc3"), note(2, b"\xa9\xe2"), note(4, b"\x82\xacb")]
    text, lp = cut.add(data, notes, final=True) or ("", {})
    assert text == "aé€b"
    assert lp["tokens"] == ["a", "é", "€b"] and "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [0, 1, 2]
    # each alternative and the sampled token are keyed by their own bytes
    assert lp["top_logprobs"][0] == {"a\ufffd": -0.5}


def test_the_final_piece_takes_the_bytes_no_token_line_covers() -> None:
    """A stop string cut a token: its first bytes are output, its line was never written."""
    cut = Cutter(1)
    assert cut.add(b"ab", [note(0, b"a")]) == ("a", {
        "tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}],
        "text_offset": [0]})
    assert cut.add(b"", [], final=True) == ("b", {"tokens": [], "token_logprobs": [],
                                                  "top_logprobs": [], "text_offset": []})
    assert cut.add(b"", [], final=True) is None


def test_top_logprobs_list_k_alternatives_and_the_sampled_token() -> None:
    cut = Cutter(1)
    n = note(0, b"c", -3.0, [(b"a", -0.1), (b"b", -0.2)])
    _, lp = cut.add(b"c", [n]) or ("", {})
    assert lp["top_logprobs"] == [{"a": -0.1, "c": -3.0}]  # k = 1, then the sampled one
    # two alternatives with the same text: the likelier one's logprob
    cut = Cutter(2)
    _, lp = cut.add(b"x", [note(0, b"x", -0.1, [(b"\xe2", -0.5), (b"\xe3", -0.7)])]) or ("", {})
    assert lp["top_logprobs"] == [{"\ufffd": -0.5, "x": -0.1}]


# -- the route in process --------------------------------------------------------------
class Device:
    """A scripted device for the route: each admitted request completes at once with
    ``output`` (and its annotation lines), or a SUBMIT is refused by ``refuse``."""

    def __init__(self, broker: ScriptedBroker, output: bytes = b" out") -> None:
        self.output = output
        self.submitted: list[tuple[wire.Header, wire.Submission]] = []
        self.cancelled: list[bytes] = []
        self.refuse: dict[int, tuple[int, wire.Reason, int, int]] = {}  # submit number ->
        broker.script[wire.Op.SUBMIT] = self.submit
        broker.script[wire.Op.READ] = self.read
        broker.script[wire.Op.CANCEL] = self.cancel

    def submit(self, h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
        k = len(self.submitted)
        self.submitted.append((h, wire.decode_submission(p)))
        if k in self.refuse:
            status, reason, detail, prompt_tokens = self.refuse[k]
            return h.refuse(status, reason, detail, epoch=EPOCH, prompt_tokens=prompt_tokens), b""
        return h.reply(202, epoch=EPOCH, identity=bytes([k]) * 16, phase=1, role=1,
                       prompt_tokens=10 + k), b""

    def read(self, h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
        k = h.identity[0]
        line = json.dumps(note(0, self.output)).encode() + b"\n"  # the output is one token
        data = line if h.flags & wire.READ_FLAG_ANNOTATIONS else self.output
        return h.reply(200, epoch=EPOCH, phase=int(wire.Phase.COMPLETED), role=1,
                       total=len(data), prompt_tokens=10 + k, sampled_tokens=2,
                       finish=int(wire.Finish.LENGTH)), data[h.cursor:]

    def cancel(self, h: wire.Header, p: bytes) -> tuple[wire.Header, bytes]:
        self.cancelled.append(h.identity)
        return h.reply(202, epoch=EPOCH, phase=int(wire.Phase.CANCELLED), role=1), b""


def test_the_route_submits_each_prompt_n_times_and_indexes_the_choices(gw: Any) -> None:  # noqa: F811
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        dev = Device(broker)
        r = await c.post("/v1/completions", json={
            "model": "smollm2", "prompt": ["a", "b"], "n": 2, "seed": 5, "echo": True,
            "user": "someone"})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert [(ch["index"], ch["text"]) for ch in doc["choices"]] == [
            (0, "a out"), (1, "a out"), (2, "b out"), (3, "b out")]
        assert doc["usage"] == {"prompt_tokens": 10 + 12, "completion_tokens": 8,
                                "total_tokens": 30}  # prompts 0 and 2 (each once)
        assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
        assert r.headers["x-request-id"][4:] == doc["id"][5:]
        sent = [(h.seed, s.messages[0].parts[0].data) for h, s in dev.submitted]
        assert sent == [(5, b"a"), (6, b"a"), (5, b"b"), (6, b"b")]
        assert all(h.submit_flags & wire.SUBMIT_FLAG_RAW for h, _ in dev.submitted)

    gw(test)


def test_a_refused_prompt_cancels_the_choices_admitted(gw: Any) -> None:  # noqa: F811
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        dev = Device(broker)
        dev.refuse[1] = (400, wire.Reason.PROMPT_LENGTH, 2047, 3000)
        r = await c.post("/v1/completions", json={"model": "smollm2", "prompt": ["a", "b"]})
        assert r.status_code == 400
        assert error(r)["param"] == "prompt" and error(r)["code"] == "context_length_exceeded"
        assert error(r)["message"] == ("prompt 1: the prompt has 3000 tokens; model smollm2 "
                                       "accepts at most 2047 so that one can be generated")
        assert dev.cancelled == [bytes([0]) * 16]
        dev.refuse = {0: (400, wire.Reason.PROMPT_TOKEN, 49152, 0)}
        dev.submitted, dev.cancelled = [], []
        r = await c.post("/v1/completions", json={"model": "smollm2", "prompt": [1, 49152]})
        assert (error(r)["message"], error(r)["param"]) == (
            "the prompt names token 49152, which is not in model smollm2's vocabulary",
            "prompt")
        assert dev.cancelled == []

    gw(test)


def test_a_stream_interleaves_indexed_chunks_and_ends_with_usage(gw: Any) -> None:  # noqa: F811
    async def test(c: httpx.AsyncClient, broker: ScriptedBroker) -> None:
        Device(broker)
        r = await c.post("/v1/completions", json={
            "model": "smollm2", "prompt": ["a", "b"], "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        texts: dict[int, str] = {}
        for ch in chunks[:-1]:
            assert ch["object"] == "text_completion" and ch["usage"] is None
            for choice in ch["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["text"]:
                    assert choice["logprobs"]["tokens"] == [" out"]
                else:
                    assert choice["finish_reason"] == "length"
        assert texts == {0: " out", 1: " out"}

    gw(test)
