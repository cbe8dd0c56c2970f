"""Dry runs (SUBMIT_FLAG_DRY) on a device with a scripted model: the prompt a request
would run, from the same checks, rendering and tokenization, answered 200 and admitted
nowhere; the token ids, pieces or rendering a page at a time; and the flags' rules."""

from __future__ import annotations

import json
import struct

import pytest

from aotx import wire
from aotx.device.dry import TOKENS_PER_REPLY
from aotx.device.runtime import Device
from aotx.device.template import ChatTemplate
from aotx.engine.llama.scheduler import Scheduler

from ..helpers import png
from .devices import call

Pair = tuple[Device, Scheduler]
SUBMIT = wire.Header.request(wire.Op.SUBMIT, role=1)
DRY = wire.SUBMIT_FLAG_DRY


def text(s: str) -> wire.Part:
    return wire.Part(wire.PartKind.TEXT, s.encode())


def chat(*texts: str) -> bytes:
    return wire.encode_submission(wire.Submission(tuple(
        wire.Message(wire.Role.USER, (text(t),)) for t in texts)))


def raw(part: wire.Part) -> bytes:
    return wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (part,)),)))


def test_a_dry_run_counts_what_the_request_would_run_and_admits_nothing(device: Pair) -> None:
    dev, _ = device
    dev.state.models[1].template = ChatTemplate(
        "{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    body = chat("hello", "there")
    dh, data = call(dev, SUBMIT._replace(flags=DRY), body)
    assert (dh.status, data) == (200, b"")
    assert not dev.state.requests and not dev.state.active
    assert dev.state.counters.admitted == 0
    ah, _ = call(dev, SUBMIT, body)
    assert ah.status == 202
    assert dh.prompt_tokens == ah.prompt_tokens == len("<hello><there>")


def test_the_ids_the_pieces_and_the_rendering_of_a_dry_run(device: Pair) -> None:
    dev, _ = device
    dev.state.models[1].template = ChatTemplate("[{{ messages[0]['content'] }}]")
    expect = [100 + b % 50 for b in b"[ab]"]
    h, data = call(dev, SUBMIT._replace(flags=DRY | wire.SUBMIT_DRY_TOKENS), chat("ab"))
    assert list(struct.unpack(f"<{len(data) // 4}i", data)) == expect
    assert h.total == 4
    h, data = call(dev, SUBMIT._replace(flags=DRY | wire.SUBMIT_DRY_PIECES), chat("ab"))
    assert wire.decode_pieces(data) == [(t, f"<{t}>".encode()) for t in expect]
    h, data = call(dev, SUBMIT._replace(flags=DRY | wire.SUBMIT_DRY_TEXT), chat("ab"))
    assert (data, h.total, h.prompt_tokens) == (b"[ab]", 4, 4)
    # from first_item on: the caller pages through a long answer
    h, data = call(dev, SUBMIT._replace(flags=DRY | wire.SUBMIT_DRY_TEXT, limit=2), chat("ab"))
    assert data == b"b]"
    h, data = call(dev, SUBMIT._replace(flags=DRY | wire.SUBMIT_DRY_TOKENS, limit=3), chat("ab"))
    assert list(struct.unpack("<1i", data)) == expect[3:]


def test_a_dry_raw_prompt_gives_token_ids_their_bytes(device: Pair) -> None:
    """/detokenize: a raw prompt of token ids, checked against the vocabulary."""
    dev, _ = device
    flags = DRY | wire.SUBMIT_FLAG_RAW | wire.SUBMIT_DRY_PIECES
    ids = wire.Part(wire.PartKind.TOKENS, struct.pack("<3I", 101, 0, 149))
    h, data = call(dev, SUBMIT._replace(flags=flags), raw(ids))
    assert h.status == 200
    assert wire.decode_pieces(data) == [(101, b"<101>"), (0, b"<0>"), (149, b"<149>")]
    bad = wire.Part(wire.PartKind.TOKENS, struct.pack("<2I", 101, 150))
    h, _ = call(dev, SUBMIT._replace(flags=flags), raw(bad))
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.PROMPT_TOKEN, 150)


def test_an_empty_dry_raw_text_is_no_tokens_not_a_refusal(device: Pair) -> None:
    dev, _ = device
    flags = DRY | wire.SUBMIT_FLAG_RAW | wire.SUBMIT_DRY_TOKENS | wire.SUBMIT_DRY_BARE
    h, data = call(dev, SUBMIT._replace(flags=flags), raw(text("")))
    assert (h.status, h.prompt_tokens, data) == (200, 0, b"")


def test_a_long_answer_comes_in_pages(device: Pair) -> None:
    dev, _ = device
    ids = list(range(TOKENS_PER_REPLY + 10))
    dev.state.models[1].engine.n_vocab = len(ids)  # type: ignore[misc]
    flags = DRY | wire.SUBMIT_FLAG_RAW | wire.SUBMIT_DRY_TOKENS
    body = raw(wire.Part(wire.PartKind.TOKENS, struct.pack(f"<{len(ids)}I", *ids)[:60000]))
    n = 15000  # what fits the submission
    h, first = call(dev, SUBMIT._replace(flags=flags), body)
    assert h.prompt_tokens == n and len(first) == 4 * n
    h, rest = call(dev, SUBMIT._replace(flags=flags, limit=n - 5), body)
    assert struct.unpack("<5i", rest) == tuple(ids[n - 5:n])


@pytest.mark.parametrize("bit", [wire.SUBMIT_DRY_TOKENS, wire.SUBMIT_DRY_PIECES,
                                 wire.SUBMIT_DRY_TEXT, wire.SUBMIT_DRY_BARE,
                                 wire.SUBMIT_DRY_SPECIAL])
def test_a_dry_runs_flag_needs_the_dry_run(device: Pair, bit: int) -> None:
    dev, _ = device
    h, _ = call(dev, SUBMIT._replace(flags=bit), chat("a"))
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.NONZERO_FIELD, 116)
    assert not dev.state.requests


def test_a_dry_run_is_checked_as_the_request(device: Pair) -> None:
    """The grant's model mask and actions, and the prompt's own refusals, apply."""
    dev, _ = device
    dev.state.grants[7] = dev.state.grants[7]._replace(model_mask=0)
    h, _ = call(dev, SUBMIT._replace(flags=DRY), chat("a"))
    assert (h.status, h.reason) == (404, wire.Reason.NO_MODEL)
    dev.state.grants[7] = dev.state.grants[7]._replace(model_mask=2,
                                                       actions=int(wire.Action.READ))
    h, _ = call(dev, SUBMIT._replace(flags=DRY), chat("a"))
    assert (h.status, h.reason) == (403, wire.Reason.ACTION)


def test_a_dry_run_with_media_counts_their_positions_and_gives_the_leases_back(
        device: Pair) -> None:
    dev, _ = device
    rh, body = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"u" * 16, role=1,
                                     flags=wire.MEDIA_FLAG_FINAL), png(3))
    digest = wire.decode_media_meta(body[:64]).digest
    sub = wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        text("ab"), wire.Part(wire.PartKind.IMAGE_DIGEST, digest), text("c"))),)))
    h, _ = call(dev, SUBMIT._replace(flags=DRY), sub)
    assert (h.status, h.prompt_tokens) == (200, 2 + 2 + 1)  # the fake projector's 2
    meta = wire.decode_media_meta(call(dev, wire.Header(op=wire.Op.MEDIA_READ,
                                                        identity=rh.identity))[1][:64])
    assert meta.leases == 0 and not dev.state.requests


def test_a_dry_runs_first_page_counts_against_the_rate_and_its_refusals_do_not(
        device: Pair) -> None:
    dev, _ = device
    dev.state.grants[7] = dev.state.grants[7]._replace(rate_per_minute=2)
    flags = DRY | wire.SUBMIT_DRY_TEXT
    assert call(dev, SUBMIT._replace(flags=flags), chat("ab"))[0].status == 200
    # later pages of the same answer are not another admission
    for _ in range(3):
        assert call(dev, SUBMIT._replace(flags=flags, limit=1), chat("ab"))[0].status == 200
    assert call(dev, SUBMIT._replace(flags=flags), chat("ab"))[0].status == 200
    h, _ = call(dev, SUBMIT._replace(flags=flags), chat("ab"))
    assert (h.status, h.reason) == (429, wire.Reason.RATE_LIMIT)
    assert call(dev, SUBMIT, chat("ab"))[0].status == 429  # the same minute's admissions
    assert sum(dev.state.counters.refused.values()) == 1  # the real one only


def test_template_arguments_reach_the_template_and_its_own_names_are_refused(
        device: Pair) -> None:
    dev, _ = device
    dev.state.models[1].template = ChatTemplate(
        "{{ messages[0]['content'] }}{% if enable_thinking is defined and not enable_thinking %}"
        "<no-think>{% endif %}")

    def rendering(args: dict[str, object] | None) -> tuple[wire.Header, bytes]:
        sub = wire.Submission((wire.Message(wire.Role.USER, (text("q"),)),),
                              template_args=json.dumps(args).encode() if args else b"")
        return call(dev, SUBMIT._replace(flags=DRY | wire.SUBMIT_DRY_TEXT),
                    wire.encode_submission(sub))

    assert rendering(None)[1] == b"q"
    assert rendering({"enable_thinking": False})[1] == b"q<no-think>"
    assert rendering({"enable_thinking": True})[1] == b"q"
    for bad in ({"messages": []}, {"add_generation_prompt": False}):
        h, _ = rendering(bad)
        assert (h.status, h.reason) == (400, wire.Reason.TEMPLATE_ARGS), bad
