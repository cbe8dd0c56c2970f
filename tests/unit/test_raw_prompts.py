"""Raw prompts (SUBMIT_FLAG_RAW, a text completion's) on a device with a scripted model:
no chat template, the text tokenized as text, token ids taken as given and checked
against the vocabulary, and the shapes a raw submission may not take."""

from __future__ import annotations

import struct

import pytest

from aotx import wire
from aotx.device.runtime import Device
from aotx.device.template import ChatTemplate
from aotx.engine.llama.scheduler import Scheduler

from .devices import call

Pair = tuple[Device, Scheduler]
RAW = wire.Header.request(wire.Op.SUBMIT, role=1, submit_flags=wire.SUBMIT_FLAG_RAW)


def text(s: str) -> wire.Part:
    return wire.Part(wire.PartKind.TEXT, s.encode())


def tokens(*ids: int) -> wire.Part:
    return wire.Part(wire.PartKind.TOKENS, struct.pack(f"<{len(ids)}I", *ids))


def payload(*messages: tuple[wire.Role, tuple[wire.Part, ...]]) -> bytes:
    return wire.encode_submission(wire.Submission(tuple(wire.Message(r, p) for r, p in messages)))


def prompt_of(dev: Device, h: wire.Header) -> list[int]:
    assert h.status == 202, h
    return dev.state.requests[h.identity].prompt


def test_a_raw_text_is_tokenized_without_the_template(device: Pair) -> None:
    dev, _ = device
    dev.state.models[1].template = ChatTemplate("[{{ messages[0]['content'] }}]")
    one = payload((wire.Role.USER, (text("ab"),)))
    chat, _ = call(dev, RAW._replace(flags=0), one)
    raw, _ = call(dev, RAW, one)
    # TokenizingEngine: one token a byte (100 + byte % 50); the template adds "[" and "]"
    assert prompt_of(dev, chat) == [100 + b % 50 for b in b"[ab]"]
    assert prompt_of(dev, raw) == [100 + b % 50 for b in b"ab"]
    assert raw.prompt_tokens == 2


def test_token_ids_are_taken_as_given_within_the_vocabulary(device: Pair) -> None:
    dev, _ = device
    h, _ = call(dev, RAW, payload((wire.Role.USER, (tokens(5, 149, 0),))))
    assert prompt_of(dev, h) == [5, 149, 0]
    h, _ = call(dev, RAW, payload((wire.Role.USER, (tokens(5, 150, 7000),))))
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.PROMPT_TOKEN, 150)


@pytest.mark.parametrize("body", [
    payload((wire.Role.USER, (text("a"),)), (wire.Role.USER, (text("b"),))),  # two messages
    payload((wire.Role.USER, (text("a"), text("b")))),  # two parts
    payload((wire.Role.SYSTEM, (text("a"),))),  # not a user message
    payload((wire.Role.USER, ())),  # no part
    payload((wire.Role.USER, (wire.Part(wire.PartKind.IMAGE_DIGEST, bytes(32)),))),
    payload((wire.Role.USER, (text(""),))),  # no token to evaluate (no BOS here)
])
def test_a_raw_submission_is_one_user_message_of_one_part(device: Pair, body: bytes) -> None:
    dev, _ = device
    h, _ = call(dev, RAW, body)
    assert (h.status, h.reason) == (400, wire.Reason.MALFORMED)
    assert not dev.state.requests


def test_token_parts_belong_to_raw_prompts_only(device: Pair) -> None:
    dev, _ = device
    h, _ = call(dev, RAW._replace(flags=0), payload((wire.Role.USER, (tokens(5),))))
    assert (h.status, h.reason) == (400, wire.Reason.MALFORMED)


def test_a_raw_prompt_keeps_the_rest_of_the_submission(device: Pair) -> None:
    """Stop strings, the sampling record and the output limit apply as to any request."""
    dev, _ = device
    sub = wire.Submission((wire.Message(wire.Role.USER, (text("abc"),)),), ("zz",),
                          wire.Sampling(presence=0.5, logprobs=3))
    h, _ = call(dev, RAW._replace(limit=2), wire.encode_submission(sub))
    req = dev.state.requests[h.identity]
    assert (req.stops, req.sampling.logprobs, req.max_tokens) == ((b"zz",), 3, 2)
    ctx = dev.state.models[1].engine.slot_context
    long = payload((wire.Role.USER, (tokens(*[5] * ctx),)))  # no room for one output token
    h, _ = call(dev, RAW, long)
    assert (h.status, h.reason, h.detail, h.prompt_tokens) == (
        400, wire.Reason.PROMPT_LENGTH, ctx - 1, ctx)
