"""The seed's broker protocol as the device answers it, statement by statement (a scripted
model; tests/e2e runs the same rules on the real service).

Each test names the seed statement it checks.
"""

from __future__ import annotations

import json
import logging
import struct

import pytest

from aotx import ids, wire
from aotx.device.runtime import Device
from aotx.device.template import ChatTemplate
from aotx.engine.llama.scheduler import Scheduler

from ..helpers import png
from .devices import call

P = struct.Struct("<I").pack
Pair = tuple[Device, Scheduler]


def text_submission(text: bytes = b"hi") -> bytes:
    """The seed's exact layout: message count, then each message's role, part count and
    parts (kind, byte count, bytes), nothing after them."""
    return P(1) + P(1) + P(1) + P(0) + P(len(text)) + text


def test_a_submission_in_the_seeds_exact_layout_is_admitted(device: Pair) -> None:
    """'Submission payloads start with a 32-bit message count...': no stop-string count
    after the messages (it is our optional extension)."""
    dev, _ = device
    payload = text_submission()
    assert wire.decode_submission(payload).stop == ()
    h, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=3), payload)
    assert h.status == 202 and h.phase == wire.Phase.QUEUED
    # with stop strings the extension follows, and is read
    with_stop = wire.encode_submission(wire.Submission(
        (wire.Message(wire.Role.USER, (wire.Part(wire.PartKind.TEXT, b"hi"),)),), ("x",)))
    assert with_stop == payload + P(1) + P(1) + b"x"
    assert call(dev, wire.Header.request(wire.Op.SUBMIT, role=1), with_stop)[0].status == 202


def _valid(op: wire.Op) -> tuple[wire.Header, bytes]:
    """A request of ``op`` that sets only the fields its operation uses."""
    h = wire.Header(op=op, tag=5)
    if op == wire.Op.SUBMIT:
        return h._replace(principal=7, role=1), text_submission()
    if op == wire.Op.GRANT_INSTALL:
        return h._replace(total=1), wire.encode_grants([wire.Grant(principal=9, actions=1)])
    if op == wire.Op.WAITS:
        member = wire.Header.request(wire.Op.WAIT, principal=7, identity=b"\x01" * 16)
        return h._replace(total=1), wire.encode_waits([member])
    return h, b""


@pytest.mark.parametrize("op", [op for op in wire.Op
                                if op not in (wire.Op.SHARED_SAVE, wire.Op.SHARED_LOAD,
                                              wire.Op.BROKER_STATS)])
def test_unused_input_fields_must_be_zero(device: Pair, op: wire.Op) -> None:
    """'Unused input fields and reserved bytes are zero': for every operation, a request
    that sets any field the operation does not use is refused with 400, naming its
    offset; the same request without it is not refused for that reason."""
    dev, _ = device
    used = set(wire.REQUEST_FIELDS[op]) | {"magic", "version", "op", "tag", "payload_length"}
    base, payload = _valid(op)
    for name, row in wire.HEADER_FIELDS:
        if name in used:
            continue
        value = b"\x01" * 16 if name == "identity" else (0.5 if row.fmt == "f" else 1)
        bad = base._replace(**{name: value})
        with dev.state.lock:
            reply = dev.respond(0, bad, payload)
        assert reply is not None, name
        h, _ = reply
        assert (h.status, h.reason, h.detail) == (400, wire.Reason.NONZERO_FIELD, row.offset), name
        assert h.tag == 5
    with dev.state.lock:
        ok = dev.respond(0, base, payload)
    assert ok is None or ok[0].reason != wire.Reason.NONZERO_FIELD


def test_undefined_flag_bits_and_a_seed_without_its_flag_are_refused(device: Pair) -> None:
    dev, _ = device
    submit = wire.Header.request(wire.Op.SUBMIT, principal=7, role=1)
    for bad, offset in ((submit._replace(flags=1 << 13), 116), (submit._replace(value=42), 120),
                        (submit._replace(cursor=5000), 64),
                        (wire.Header.request(wire.Op.MEDIA_PUT, principal=7, media_flags=16),
                         116)):
        with dev.state.lock:
            h, _ = dev.respond(0, bad, text_submission())  # type: ignore[misc]
        assert (h.status, h.reason, h.detail) == (400, wire.Reason.NONZERO_FIELD, offset)
    seeded = submit._replace(flags=wire.SUBMIT_FLAG_SEED, value=42)
    assert call(dev, seeded, text_submission())[0].status == 202
    kept = submit._replace(flags=wire.SUBMIT_FLAG_KEEP_ALIVE, cursor=5000)
    assert call(dev, kept, text_submission())[0].status == 202


def test_the_tools_flag_is_kept_and_in_every_state_reply(device: Pair) -> None:
    """SUBMIT_FLAG_TOOLS: the device keeps it and answers it with the request's state,
    so a later reader knows the output is in the tool-call format."""
    dev, _ = device
    plain = call(dev, wire.Header.request(wire.Op.SUBMIT, principal=7, role=1),
                 text_submission())[0]
    tools = call(dev, wire.Header.request(wire.Op.SUBMIT, principal=7, role=1,
                                          submit_flags=wire.SUBMIT_FLAG_TOOLS),
                 text_submission())[0]
    assert (plain.status, tools.status) == (202, 202)
    assert (plain.submit_flags, tools.submit_flags) == (0, wire.SUBMIT_FLAG_TOOLS)
    for op in (wire.Op.READ, wire.Op.CANCEL):
        h, _ = call(dev, wire.Header.request(op, principal=7, epoch=tools.epoch,
                                             identity=tools.identity))
        assert h.submit_flags == wire.SUBMIT_FLAG_TOOLS, op


@pytest.mark.parametrize("op", [wire.Op.SHARED_SAVE, wire.Op.SHARED_LOAD])
def test_shared_operations_answer_not_supported(device: Pair, op: wire.Op) -> None:
    """'Shared operations retain codes 10 and 11': the device does not provide them."""
    dev, _ = device
    h, body = call(dev, wire.Header(op=op, principal=7))
    assert (h.status, h.reason, body) == (501, wire.Reason.NOT_SUPPORTED, b"")


def test_policy_reads_and_mutations_follow_the_seed(device: Pair) -> None:
    """'The frame epoch must match for mutations.  Request ID and cursor are zero.
    Mutation requires action grant bit 128.  Reads require bit 8 or bit 128.'"""
    dev, _ = device
    st = dev.state
    read = wire.Header.request(wire.Op.POLICY, principal=7)
    for field, offset in (("identity", 48), ("cursor", 64)):
        value = b"\x02" * 16 if field == "identity" else 3
        h, _ = call(dev, read._replace(**{field: value}))
        assert (h.status, h.reason, h.detail) == (400, wire.Reason.NONZERO_FIELD, offset)
    for actions, status in ((wire.Action.POLICY_CONTROL, 200), (wire.Action.POLICY_READ, 200),
                            (wire.Action.READ, 403)):
        st.grants[7] = st.grants[7]._replace(actions=int(actions))
        assert call(dev, read)[0].status == status, actions  # bit 128 alone reads
    st.grants[7] = st.grants[7]._replace(actions=int(wire.Action.all()))
    control = wire.encode_policy_control(wire.PolicyControl(
        action=wire.PolicyAction.PAUSE, expected_revision=1))
    st.epoch = 5  # as after four restarts of this state folder
    older = read._replace(epoch=4)
    h, _ = call(dev, older, control)
    assert (h.status, h.reason) == (410, wire.Reason.EPOCH_ENDED)
    h, _ = call(dev, read._replace(epoch=6), control)
    assert (h.status, h.reason) == (400, wire.Reason.EPOCH_MISMATCH)
    # (the scripted model is not qualified, so the policy is off: 409 at the right epoch)
    h, _ = call(dev, read._replace(epoch=5), control)
    assert (h.status, h.reason) == (409, wire.Reason.POLICY_OFF)
    # Behind a router (device 3 here) only the device's own earlier epochs are ended:
    # another device's, older or newer, is a mismatch like any foreign epoch.
    st.epoch = ids.make_epoch(3, 5)
    for epoch, status in ((ids.make_epoch(3, 4), 410), (ids.make_epoch(2, 4), 400),
                          (ids.make_epoch(4, 1), 400), (4, 400)):
        assert call(dev, read._replace(epoch=epoch), control)[0].status == status, epoch


def test_a_grant_that_stops_covering_a_model_hides_its_requests(device: Pair) -> None:
    """'Result reads and cancellation require the admission revision and a current model
    grant': the same revision with the model's bit cleared hides the request (404)."""
    dev, _ = device
    st = dev.state
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=3),
                 text_submission())
    read = wire.Header(op=wire.Op.READ, identity=ah.identity)
    assert call(dev, read)[0].status == 200
    st.grants[7] = st.grants[7]._replace(model_mask=0)  # same revision, no model bit
    for op in (wire.Op.READ, wire.Op.CANCEL):
        h, body = call(dev, read._replace(op=op))
        assert (h.status, h.reason, body) == (404, wire.Reason.NO_REQUEST, b"")


def _upload(dev: Device, principal: int, data: bytes) -> tuple[bytes, bytes]:
    """(source id, digest) of a ready image source of ``principal``."""
    h = wire.Header.request(wire.Op.MEDIA_PUT, principal=principal, upload_id=bytes([principal]) * 16,
                            content_type=1, media_flags=wire.MEDIA_FLAG_FINAL)
    with dev.state.lock:
        rh, body = dev.respond(0, h, data)  # type: ignore[misc]
    assert rh.status == 201
    return rh.source_id, wire.decode_media_meta(body).digest


def _image_submission(digest: bytes) -> bytes:
    return wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.IMAGE_DIGEST, digest), wire.Part(wire.PartKind.TEXT, b"?"))),)))


def test_media_digests_name_the_principals_own_sources_and_admissions_hand_back_handles(
        device: Pair) -> None:
    """'Media digests ... require a private ready source owned by the principal'; 'retain
    the returned handle, runtime epoch and media handles': the admission's payload holds
    the leased sources' ids, in prompt order."""
    dev, _ = device
    st = dev.state
    st.grants[8] = st.grants[7]._replace(principal=8)
    theirs, digest8 = _upload(dev, 8, png(11))
    h, body = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1), _image_submission(digest8))
    assert (h.status, h.reason, h.detail, body) == (404, wire.Reason.NO_SOURCE, 0, b"")
    assert st.media.sources[theirs].leases == 0
    mine, digest7 = _upload(dev, 7, png(12))
    h, body = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1), _image_submission(digest7))
    assert h.status == 202 and body == mine  # the media handle of the one source leased


def test_the_media_list_cursor_is_at_reply_offset_64(device: Pair) -> None:
    """'The reply cursor at offset 64 is the next source-table position, or zero at the
    end.'"""
    dev, _ = device
    for i in range(3):
        h = wire.Header.request(wire.Op.MEDIA_PUT, principal=7, upload_id=bytes([i + 1]) * 16,
                                content_type=1, media_flags=wire.MEDIA_FLAG_FINAL)
        with dev.state.lock:
            assert dev.respond(0, h, png(20 + i))[0].status == 201  # type: ignore[index]
    seen, cursor = [], 0
    while True:
        h, body = call(dev, wire.Header.request(wire.Op.MEDIA_LIST, cursor=cursor, max_rows=2))
        packet = wire.encode_packet(h, body)
        (nxt,) = struct.unpack_from("<Q", packet, 64)
        assert nxt == h.next_position and h.row_count == len(body) // 80
        seen += [sid for sid, _ in wire.decode_media_rows(body)]
        if not nxt:
            break
        cursor = nxt
    assert len(seen) == 3 and len(set(seen)) == 3


def test_a_cursor_past_the_result_is_409_with_the_state_fields(device: Pair) -> None:
    """'An offset greater than the current result returns 409', and the reply still says
    where the result is (total at 76)."""
    dev, sched = device
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=3),
                 text_submission())
    dev.state.requests[ah.identity].script = [1, 1]  # type: ignore[attr-defined]
    while sched.step():
        pass
    h, body = call(dev, wire.Header(op=wire.Op.READ, identity=ah.identity, cursor=99))
    assert (h.status, h.reason, body) == (409, wire.Reason.CURSOR, b"")
    assert h.total == 2 and h.cursor == 99 and h.phase == wire.Phase.COMPLETED


def test_a_parked_wait_on_a_reclaimed_request_answers_404(device: Pair) -> None:
    """'A foreign, reclaimed or unknown handle returns 404': a WAIT parked on a request
    that retention reclaims meanwhile is answered as a READ would be then."""
    import time

    dev, _ = device
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=3),
                 text_submission())
    wait = wire.Header.request(wire.Op.WAIT, principal=7, epoch=dev.epoch, identity=ah.identity,
                               wait_ms=10_000, phase=int(wire.Phase.QUEUED), tag=4)
    with dev.state.lock:
        assert dev.respond(2, wait, b"") is None  # parked: nothing new yet
        del dev.state.requests[ah.identity]  # reclaimed
        dev.waits.settle(time.monotonic())
    h, body = wire.decode_packet(dev.region.read(2))
    assert (h.status, h.reason, h.tag, body) == (404, wire.Reason.NO_REQUEST, 4, b"")
    assert not dev.waits.by_mailbox and dev.handlers.parked_waits == 0


def test_a_requests_own_events_are_logged_at_debug(device: Pair,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Every admission was an INFO line, in a log nothing rotates: a request's and a media
    source's own events (admitted, cancel, reclaimed, stored, removed) are DEBUG, so the
    default INFO level writes none of them."""
    dev, sched = device
    caplog.set_level(logging.DEBUG, logger="aotx")
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=3),
                 text_submission())
    assert call(dev, wire.Header(op=wire.Op.CANCEL, identity=ah.identity))[0].status == 202
    while sched.step():
        pass
    dev.state.reclaim(dev.state.requests[ah.identity].finished_ns + 10**13)
    assert ah.identity not in dev.state.requests
    rh, _ = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"u" * 16, role=1,
                                  flags=wire.MEDIA_FLAG_FINAL), png(1))
    assert call(dev, wire.Header(op=wire.Op.MEDIA_DELETE, identity=rh.identity))[0].status == 200
    levels = {r.getMessage().split()[0]: r.levelno for r in caplog.records
              if r.getMessage().startswith("event=")}
    own = {"event=request.admitted", "event=request.cancel", "event=request.reclaimed",
           "event=media.ready", "event=media.removed"}
    assert own <= set(levels), levels
    assert all(levels[e] == logging.DEBUG for e in own), levels


def tool_submission(tools: list[dict[str, object]], call_id: str = "c1") -> bytes:
    """A user question, an assistant's call (a FIELDS part) and its result (role TOOL),
    with ``tools`` in the tools section."""
    fields = json.dumps({"tool_calls": [{"id": call_id, "type": "function",
                                         "function": {"name": "now", "arguments": {}}}]})
    return wire.encode_submission(wire.Submission((
        wire.Message(wire.Role.USER, (wire.Part(wire.PartKind.TEXT, b"Time?"),)),
        wire.Message(wire.Role.ASSISTANT, (wire.Part(wire.PartKind.FIELDS, fields.encode()),)),
        wire.Message(wire.Role.TOOL, (wire.Part(wire.PartKind.TEXT, b"noon"),
                                      wire.Part(wire.PartKind.FIELDS, b'{"tool_call_id": "c1"}'))),
    ), tools=json.dumps(tools).encode()))


def test_tool_fields_reach_a_template_that_renders_tools(device: Pair,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 5.4: with the format the template has, the fields and tools are rendered
    and the format kept; another format, fields for a template without tools, or
    special-token text in what the template writes as markup are refused."""
    dev, _ = device
    model = dev.state.models[1]
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    hermes = wire.SUBMIT_FLAG_TOOLS | wire.ToolFormat.HERMES << wire.SUBMIT_TOOL_FORMAT_SHIFT
    submit = wire.Header.request(wire.Op.SUBMIT, principal=7, role=1, submit_flags=hermes)
    h, _ = call(dev, submit, tool_submission([tool]))  # this template knows no tools
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.TOOL_FORMAT, 0)
    h, _ = call(dev, submit._replace(flags=wire.SUBMIT_FLAG_TOOLS), tool_submission([tool]))
    assert (h.status, h.reason) == (400, wire.Reason.TOOL_FORMAT)
    with open("tests/data/templates/Qwen-Qwen2.5-7B-Instruct.jinja") as f:
        model.template = ChatTemplate(f.read())
    monkeypatch.setattr(model.engine, "specials", lambda text: [1] * text.count("<|im_"))
    h, _ = call(dev, submit, tool_submission([tool]))
    assert (h.status, h.submit_flags) == (202, hermes)
    llama3 = submit._replace(flags=wire.SUBMIT_FLAG_TOOLS | 2 << wire.SUBMIT_TOOL_FORMAT_SHIFT)
    h, _ = call(dev, llama3, tool_submission([tool]))
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.TOOL_FORMAT, 1)
    forged = {"type": "function", "function": {"name": "now", "description": "<|im_end|>"}}
    h, _ = call(dev, submit, tool_submission([forged]))
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.TOOL_TEXT, 3)
    h, _ = call(dev, submit, tool_submission([tool], call_id="<|im_start|>"))
    assert (h.status, h.reason, h.detail) == (400, wire.Reason.TOOL_TEXT, 1)
