"""The wire codec: seed offsets, round trips (hypothesis) and every rejection."""

from __future__ import annotations

import json
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aotx import ids, wire
from aotx.wire import WireError

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
f32 = st.floats(0, 2, width=32)


def roundtrip(encode, decode, value, *args):
    """construct-style helper: encode -> decode gives the value back, and re-encodes identically."""
    data = encode(value)
    back = decode(data, *args)
    assert back == value
    assert encode(back) == data
    return data


headers = st.builds(
    wire.Header, magic=st.just(wire.MAGIC), version=st.just(wire.VERSION),
    payload_length=st.just(0),
    op=st.sampled_from(list(wire.Op)), status=u32, phase=st.sampled_from(list(wire.Phase)),
    tag=u64, principal=u32, revision=u64, epoch=u64,
    identity=st.binary(min_size=16, max_size=16), cursor=u64, role=u32, total=u32,
    prompt_tokens=u32, sampled_tokens=u32, finish=st.sampled_from(list(wire.Finish)),
    failure=u32, cancel_requested=st.integers(0, 1), limit=u32, temperature=f32,
    top_p=f32, flags=u32, value=u64, reason=st.sampled_from(list(wire.Reason)))


@given(headers, st.binary(max_size=512))
def test_packet_roundtrip(h: wire.Header, payload: bytes) -> None:
    packet = wire.encode_packet(h, payload)
    assert len(packet) == wire.HEADER_SIZE + len(payload)
    back, body = wire.decode_packet(packet)
    assert body == payload
    assert back == h._replace(payload_length=len(payload))  # encoding does not change h
    assert h.payload_length == 0


def test_seed_offsets() -> None:
    """The offsets the seed fixes, read back with plain struct at those offsets."""
    h = wire.Header(op=wire.Op.READ, status=404, phase=wire.Phase.RUNNING, epoch=0x0102030405060708,
                    cursor=77, role=2, total=1234, prompt_tokens=11, sampled_tokens=22,
                    finish=wire.Finish.LENGTH, failure=503, cancel_requested=1)
    p = wire.encode_packet(h, b"xyz")
    get = lambda fmt, off: struct.unpack_from("<" + fmt, p, off)[0]  # noqa: E731
    assert get("I", 8) == 404
    assert get("I", 12) == wire.Phase.RUNNING == 3
    assert get("Q", 40) == 0x0102030405060708
    assert get("Q", 64) == 77
    assert get("I", 72) == 2
    assert get("I", 76) == 1234
    assert get("I", 80) == 11
    assert get("I", 84) == 22
    assert get("I", 88) == 3
    assert get("I", 92) == 2
    assert get("I", 96) == 503
    assert get("I", 100) == 1
    assert [p.name for p in wire.Phase] == ["FREE", "QUEUED", "PREPARING", "RUNNING",
                                            "COMPLETED", "FAILED", "CANCELLED"]
    assert (wire.Finish.STOP, wire.Finish.LENGTH) == (1, 2)
    assert (wire.Role.SYSTEM, wire.Role.USER, wire.Role.ASSISTANT) == (0, 1, 2)
    assert (wire.PartKind.TEXT, wire.PartKind.IMAGE_DIGEST, wire.PartKind.AUDIO_DIGEST) == (0, 1, 2)
    assert wire.Action.POLICY_READ == 8 and wire.Action.POLICY_CONTROL == 128


def _good() -> bytearray:
    return bytearray(wire.encode_packet(wire.Header(op=wire.Op.INFO), b"ab"))


@pytest.mark.parametrize("mutate,status", [
    (lambda p: p[:100], 400),                                     # shorter than the header
    (lambda p: p.__setitem__(0, 0) or p, 400),                    # bad magic
    (lambda p: struct.pack_into("<H", p, 4, 2) or p, 505),        # version
    (lambda p: struct.pack_into("<H", p, 6, 99) or p, 400),       # unknown op
    (lambda p: struct.pack_into("<I", p, 12, 7) or p, 400),       # unknown phase
    (lambda p: struct.pack_into("<I", p, 92, 3) or p, 400),       # unknown finish
    (lambda p: struct.pack_into("<I", p, 28, 999) or p, 400),     # unknown reason (was flags)
    (lambda p: struct.pack_into("<I", p, 100, 2) or p, 400),      # cancel flag not 0/1
    (lambda p: struct.pack_into("<I", p, 88, 3) or p, 400),       # payload length overruns
    (lambda p: struct.pack_into("<I", p, 88, 1) or p, 400),       # trailing bytes
    (lambda p: struct.pack_into("<I", p, 88, 70000) or p, 413),   # payload length > max
    (lambda p: p + bytes(wire.MAX_PACKET), 413),                  # packet > 65536
])
def test_packet_rejections(mutate, status) -> None:
    with pytest.raises(WireError) as err:
        wire.decode_packet(bytes(mutate(_good())))
    assert err.value.status == status


def test_encode_refuses_oversize_payload() -> None:
    with pytest.raises(WireError) as err:
        wire.encode_packet(wire.Header(op=wire.Op.SUBMIT), bytes(wire.MAX_PAYLOAD + 1))
    assert err.value.status == 413
    assert len(wire.encode_packet(wire.Header(op=wire.Op.SUBMIT), bytes(wire.MAX_PAYLOAD))) == 65536


text_parts = st.builds(lambda t: wire.Part(wire.PartKind.TEXT, t.encode()), st.text(max_size=40))
digest_parts = st.builds(wire.Part, st.sampled_from([wire.PartKind.IMAGE_DIGEST,
                                                     wire.PartKind.AUDIO_DIGEST]),
                         st.binary(min_size=32, max_size=32))
token_parts = st.builds(lambda ids: wire.Part(wire.PartKind.TOKENS,
                                               struct.pack(f"<{len(ids)}I", *ids)),
                        st.lists(u32, min_size=1, max_size=6))
field_parts = st.builds(lambda d: wire.Part(wire.PartKind.FIELDS, json.dumps(d).encode()),
                        st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
messages = st.builds(wire.Message, st.sampled_from(list(wire.Role)),
                     st.lists(text_parts | digest_parts | token_parts | field_parts,
                              max_size=4).map(tuple))
f32 = {"width": 32}
samplings = st.builds(
    wire.Sampling, top_k=u32, min_p=st.floats(0, 1, **f32), presence=st.floats(-2, 2, **f32),
    frequency=st.floats(-2, 2, **f32), repetition=st.floats(0.5, 10, **f32), last_n=u32,
    bias_count=st.just(0), logprobs=st.integers(0, wire.MAX_TOP_LOGPROBS + 1),
    bias=st.lists(st.tuples(st.integers(0, 2**31), st.floats(-100, 100, **f32)),
                  max_size=4).map(tuple))
constraints = st.builds(wire.Constraint, st.sampled_from(list(wire.GrammarKind)[1:]),
                        st.text(max_size=20))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
tool_sections = st.lists(json_values, max_size=3).map(lambda v: json.dumps(v).encode())
submissions = st.builds(wire.Submission, st.lists(messages, min_size=1, max_size=5).map(tuple),
                        st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
                        st.just(wire.Sampling()) | samplings, st.none() | constraints,
                        st.just(b"") | tool_sections, st.just(b""))
template_args = st.dictionaries(st.text(max_size=5), json_values, min_size=1, max_size=3).map(
    lambda v: json.dumps(v).encode())


@given(submissions)
def test_submission_roundtrip(sub: wire.Submission) -> None:
    data = roundtrip(wire.encode_submission, wire.decode_submission, sub)
    assert struct.unpack_from("<I", data, 0)[0] == len(sub.messages)


@given(submissions, template_args)
def test_template_arguments_follow_the_tools(sub: wire.Submission, args: bytes) -> None:
    """With or without tools (an empty tools section holds their place)."""
    roundtrip(wire.encode_submission, wire.decode_submission, sub._replace(template_args=args))


def _sub(*chunks: bytes) -> bytes:
    return b"".join(chunks)


P = struct.Struct("<I").pack


@pytest.mark.parametrize("payload,fragment", [
    (b"", "ends inside"),
    (P(0) + P(0), "at least one message"),
    (P(5000), "exceeds"),
    (P(1) + P(4) + P(0) + P(0), "unknown message role"),
    (P(1) + P(1) + P(1) + P(7) + P(1) + b"x" + P(0), "unknown part kind"),
    (P(1) + P(1) + P(1) + P(0) + P(10) + b"abc", "overruns"),
    (P(1) + P(1) + P(1) + P(0) + P(2) + b"\xc3\x28" + P(0), "UTF-8"),
    (P(1) + P(1) + P(1) + P(1) + P(31) + bytes(31) + P(0), "exactly 32"),
    (P(1) + P(1) + P(1) + P(2) + P(33) + bytes(33) + P(0), "exactly 32"),
    # a token part (raw prompts) holds whole u32 ids, at least one
    (P(1) + P(1) + P(1) + P(3) + P(0), "u32 token ids"),
    (P(1) + P(1) + P(1) + P(3) + P(6) + bytes(6), "u32 token ids"),
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling()[:-1]) + P(1) + P(2)
     + b"{}" + P(2) + b"[]" + P(2) + b"{}" + b"junk", "trailing"),
    # template arguments (after the tools, maybe an empty section) are a JSON object
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling()[:-1]) + P(0) + P(0)
     + P(0) + P(2) + b"[]", "JSON object"),
    # the tools section (after a constraint, NONE holding its place) is a JSON array
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling()[:-1]) + P(0) + P(0)
     + P(2) + b"{}", "JSON array"),
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling()[:-1]) + P(0) + P(1)
     + b"x", "NONE constraint"),
    # a FIELDS part is a JSON object
    (P(1) + P(2) + P(1) + P(4) + P(2) + b"[]" + P(0), "JSON object"),
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling()[:-1]) + P(9) + P(0),
     "grammar kind"),
    (P(1) + P(1) + P(0) + P(0) + b"junk", "overruns"),  # a sampling record is 32 bytes
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling(repetition=0)[:-1]),
     "sampling"),
    (P(1) + P(1) + P(0) + P(0) + wire.SAMPLING.pack(*wire.Sampling(logprobs=22)[:-1]),
     "sampling"),  # logprobs: 0 off, k + 1 for k <= 20 alternatives
    (P(1) + P(1) + P(0) + P(1) + P(0), "empty stop"),
    (P(1) + P(1) + P(0) + P(17), "stop count"),
    (P(1) + P(1) + P(0) + P(1) + P(1025) + b"s" * 1025, "exceeds 1024"),
    (P(1) + P(1) + P(0) + P(1) + P(2) + b"\xff\xfe", "UTF-8"),
    (P(1) + P(1) + P(5000), "part count"),
])
def test_submission_rejections(payload: bytes, fragment: str) -> None:
    with pytest.raises(WireError) as err:
        wire.decode_submission(payload)
    assert fragment in err.value.message
    assert err.value.status == 400


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_decoders_never_raise_anything_but_wire_error(data: bytes) -> None:
    for decode in (wire.decode_submission, wire.decode_info, wire.decode_media_rows,
                   wire.decode_policy_control, wire.decode_policy_status, wire.decode_telemetry,
                   wire.decode_header, wire.decode_packet, wire.decode_media_meta,
                   lambda d: wire.decode_grants(d, len(d) // 64)):
        try:
            decode(data)
        except WireError as exc:
            assert 400 <= exc.status < 600


@settings(max_examples=200)
@given(submissions, st.data())
def test_truncated_or_flipped_submissions_are_rejected_cleanly(sub: wire.Submission, data) -> None:
    raw = bytearray(wire.encode_submission(sub))
    cut = data.draw(st.integers(0, len(raw) - 1))
    plain = sub._replace(sampling=wire.Sampling(), constraint=None, tools=b"")
    # Cuts that leave a whole payload: just after the messages (the seed's own layout,
    # without the extensions), just after the stop strings (without the sampling), just
    # before the constraint (or the NONE one before tools), or just before the tools.
    whole = {len(wire.encode_submission(plain._replace(stop=()))): plain._replace(stop=()),
             len(wire.encode_submission(plain)) + 4 * (not sub.stop): plain}
    tail = 4 + len(sub.tools) if sub.tools else 0
    if sub.tools:
        whole[len(raw) - tail] = sub._replace(tools=b"")
    if sub.constraint is not None or sub.tools:
        text = sub.constraint.text.encode() if sub.constraint is not None else b""
        whole[len(raw) - tail - 8 - len(text)] = sub._replace(constraint=None, tools=b"")
    if cut in whole:
        assert wire.decode_submission(bytes(raw[:cut])) == whole[cut]
    else:
        with pytest.raises(WireError):
            wire.decode_submission(bytes(raw[:cut]))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        wire.decode_submission(bytes(raw))
    except WireError:
        pass


model_infos = st.builds(wire.ModelInfo, role=st.integers(0, 31), alias=st.text(min_size=1, max_size=12),
                        sha256=st.binary(min_size=32, max_size=32), modalities=st.integers(0, 7),
                        published_at=u64, context_tokens=u32, automatic_memory=st.booleans(),
                        embedding_dims=u32, embedding_tokens=u32, rerank=st.booleans())
infos = st.builds(wire.Info, epoch=u64,
                  models=st.lists(model_infos, max_size=5, unique_by=lambda m: m.role).map(tuple),
                  window_bytes=u32, context_tokens=u32, output_tokens=u32, active_requests=u32,
                  slots=u32, media_bytes=u64, retention_seconds=u32, retention_requests=u32,
                  mailboxes=u32, kv_cells=u32, started_unix_ns=u64, schema=st.just(1),
                  abi=st.just(1), max_packet=u32, max_payload=u32, reserved_84=st.just(bytes(72)),
                  reserved_160=st.just(bytes(32)), model_count=st.just(0),
                  memory_roles=st.just(0), rerank_roles=st.just(0)).map(
    # the payload's count and role bits are the models' (encode_info computes them)
    lambda i: i._replace(model_count=len(i.models), memory_roles=sum(
        1 << m.role for m in i.models if m.automatic_memory), rerank_roles=sum(
        1 << m.role for m in i.models if m.rerank)))


@given(infos)
def test_info_roundtrip(info: wire.Info) -> None:
    data = roundtrip(wire.encode_info, wire.decode_info, info)
    assert len(data) >= 192 + 40 * len(info.models)
    bits = struct.unpack_from("<I", data, 156)[0]
    assert bits == sum(1 << m.role for m in info.models if m.automatic_memory)
    assert struct.unpack_from("<I", data, 80)[0] == sum(1 << m.role for m in info.models
                                                        if m.rerank)


def test_info_rows_carry_the_embedding_limits() -> None:
    m = wire.ModelInfo(3, "e", bytes(32), 1, 0, 2048, False, 576, 512)
    data = wire.encode_info(wire.Info(epoch=1, models=(m,)))
    assert struct.unpack_from("<II", data, 192 + 32) == (576, 512)  # the row's 8 bytes at 32
    assert wire.decode_info(data).models == (m,)


def test_info_rejections() -> None:
    m = wire.ModelInfo(2, "a", bytes(32), 1, 0, 0, True)
    good = bytearray(wire.encode_info(wire.Info(
        epoch=1, models=(m,), window_bytes=1, context_tokens=1, output_tokens=1,
        active_requests=1, slots=1, media_bytes=1, retention_seconds=1, retention_requests=1,
        mailboxes=1, kv_cells=1, started_unix_ns=1)))
    for off, val, frag in [(100, 1, "reserved"), (156, 1 << 5, "not visible"),
                           (16, 9, "overruns"), (170, 1, "reserved")]:
        bad = bytearray(good)
        struct.pack_into("<I", bad, off, val)
        with pytest.raises(WireError, match=frag):
            wire.decode_info(bytes(bad))
    with pytest.raises(WireError):
        wire.decode_info(bytes(good[:191]))


grants = st.builds(wire.Grant, principal=st.integers(1, 2**32 - 1), actions=st.integers(0, 255),
                   model_mask=u64, revision=u64, flags=st.integers(0, 1), max_active=u32,
                   max_output_tokens=u32, max_input_bytes=u32, max_media_sources=u32,
                   max_media_bytes=u64, rate_per_minute=u32, reserved_20=st.just(0),
                   reserved_60=st.just(0))


@given(st.lists(grants, max_size=8))
def test_grant_rows_roundtrip(rows: list[wire.Grant]) -> None:
    data = wire.encode_grants(rows)
    assert len(data) == 64 * len(rows)
    assert wire.decode_grants(data, len(rows)) == rows


def test_grant_rejections() -> None:
    row = bytearray(wire.encode_grants([wire.Grant(principal=1, actions=3, model_mask=1)]))
    with pytest.raises(WireError, match="need 128"):
        wire.decode_grants(bytes(row), 2)
    for off, fmt, val, frag in [(20, "I", 1, "reserved"), (60, "I", 1, "reserved"),
                                (16, "I", 256, "unknown action"), (4, "I", 2, "flags"),
                                (0, "I", 0, "reserved")]:
        bad = bytearray(row)
        struct.pack_into("<" + fmt, bad, off, val)
        with pytest.raises(WireError, match=frag):
            wire.decode_grants(bytes(bad), 1)
    assert b"token" not in bytes(row)  # rows carry no credential material at all


metas = st.builds(wire.MediaMeta, digest=st.binary(min_size=32, max_size=32), size=u64,
                  kind=st.sampled_from([wire.PartKind.IMAGE_DIGEST, wire.PartKind.AUDIO_DIGEST]),
                  state=st.sampled_from(list(wire.MediaState)), leases=u32,
                  content_type=st.sampled_from(sorted(wire.MEDIA_TYPES)), created_ms=u64)


@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16), metas), max_size=6))
def test_media_rows_roundtrip(rows) -> None:
    data = wire.encode_media_rows(rows)
    assert len(data) == 80 * len(rows)
    assert wire.decode_media_rows(data) == rows
    for i, (sid, meta) in enumerate(rows):
        assert data[80 * i:80 * i + 16] == sid
        assert data[80 * i + 16:80 * i + 48] == meta.digest


def test_media_rejections() -> None:
    meta = wire.MediaMeta(bytes(32), 5, wire.PartKind.IMAGE_DIGEST, wire.MediaState.READY, 0, 1, 0)
    row = bytearray(wire.encode_media_rows([(bytes(16), meta)]))
    with pytest.raises(WireError):
        wire.decode_media_rows(bytes(row[:79]))
    # kind 3 is a prompt's token part, never a media source's kind
    for off, val in [(16 + 40, 0), (16 + 40, 3), (16 + 44, 9), (16 + 52, 999)]:
        bad = bytearray(row)
        struct.pack_into("<I", bad, off, val)
        with pytest.raises(WireError):
            wire.decode_media_rows(bytes(bad))


@given(st.sampled_from(list(wire.PolicyAction)), u64)
def test_policy_control_roundtrip(action, rev) -> None:
    c = wire.PolicyControl(action=action, expected_revision=rev)
    data = roundtrip(wire.encode_policy_control, wire.decode_policy_control, c)
    assert len(data) == 16 and struct.unpack("<IIQ", data) == (1, int(action), rev)


def test_policy_control_rejections() -> None:
    with pytest.raises(WireError):
        wire.decode_policy_control(struct.pack("<IIQ", 2, 1, 0))
    with pytest.raises(WireError):
        wire.decode_policy_control(struct.pack("<IIQ", 1, 6, 0))
    with pytest.raises(WireError):
        wire.decode_policy_control(b"\x01" * 15)


statuses = st.builds(wire.PolicyStatus, mode=u32, state=st.sampled_from(list(wire.PolicyState)),
                     review_enabled=st.integers(0, 1), pending=u32, active_rows=u32,
                     result_status=u32, control_revision=u64, source_frontier=u64, completed=u64,
                     interrupted=u64, refused=u64, decision=u64, saved_generation=u64, max_ns=u64,
                     last_ns=u64, written_bytes=u64, result_bytes=u64,
                     reason=st.sampled_from(list(wire.PolicyReason)), schema=st.just(1),
                     abi=st.just(1), reserved=st.just(bytes(36)))


@given(statuses)
def test_policy_status_roundtrip(s: wire.PolicyStatus) -> None:
    data = roundtrip(wire.encode_policy_status, wire.decode_policy_status, s)
    assert len(data) == 160
    assert struct.unpack_from("<I", data, 12)[0] == s.state
    assert struct.unpack_from("<Q", data, 32)[0] == s.control_revision
    assert struct.unpack_from("<Q", data, 80)[0] == s.saved_generation
    assert struct.unpack_from("<I", data, 120)[0] == s.reason
    assert data[124:] == bytes(36)


def test_policy_status_rejects_nonzero_tail() -> None:
    data = bytearray(wire.encode_policy_status(wire.PolicyStatus()))
    data[150] = 1
    with pytest.raises(WireError):
        wire.decode_policy_status(bytes(data))


@given(u64, u64, u64)
def test_telemetry_roundtrip(a, t, c) -> None:
    roundtrip(wire.encode_telemetry, wire.decode_telemetry, wire.Telemetry(a, t, c))


@given(u64, st.binary(min_size=16, max_size=16))
def test_request_id_roundtrip(epoch: int, ident: bytes) -> None:
    rid = ids.format_request_id(epoch, ident)
    assert len(rid) == 53 and rid == rid.lower()
    assert ids.parse_request_id(rid) == (epoch, ident)


@given(st.integers(0, ids.MAX_DEVICE_ID), st.integers(1, (1 << 48) - 1),
       st.integers(0, ids.MAX_DEVICE_ID), st.integers(1, (1 << 48) - 1))
def test_an_epoch_is_ended_only_for_its_own_device(d1: int, n1: int, d2: int, n2: int) -> None:
    old, now = ids.make_epoch(d1, n1), ids.make_epoch(d2, n2)
    assert ids.device_of(old) == d1
    assert ids.format_request_id(old, bytes(16)).startswith(f"req-{d1:04x}")
    assert ids.ended(old, now) == (d1 == d2 and n1 < n2)


def test_epochs_outside_the_device_and_count_ranges_are_refused() -> None:
    for device, count in ((-1, 1), (1 << 16, 1), (0, 0), (0, 1 << 48)):
        with pytest.raises(ValueError):
            ids.make_epoch(device, count)
    assert ids.make_epoch(0, 7) == 7  # device 0: the epochs of a single device, as before


@pytest.mark.parametrize("bad", [
    "", "req-", "req-0000000000000001-0000000000000000000000000000000",
    "req-0000000000000001-000000000000000000000000000000001",
    "req-000000000000000G-00000000000000000000000000000001",
    "REQ-0000000000000001-00000000000000000000000000000001",
    "req-0000000000000001-0000000000000000000000000000000A",
    "req-0000000000000001_00000000000000000000000000000001",
])
def test_request_id_rejections(bad: str) -> None:
    assert ids.parse_request_id(bad) is None


DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")
#: The layouts whose tables docs/protocol.md carries, by the name its markers use.
LAYOUTS = {"Header": wire.Header, "Info": wire.Info, "ModelRow": wire.ModelRow,
           "Grant": wire.Grant, "MediaMeta": wire.MediaMeta,
           "PolicyStatus": wire.PolicyStatus, "Telemetry": wire.Telemetry,
           "Sampling": wire.Sampling}
_TYPES = {"I": "u32", "H": "u16", "Q": "u64", "f": "f32"}


def layout_table(record: type) -> str:
    """The Markdown table of a layout, from its rows (and, for the header, the named
    accessors of each field)."""
    views: dict[str, list[str]] = {}
    for name, attr in vars(record).items():
        if isinstance(attr, wire._View):
            views.setdefault(attr.field, []).append(f"`{name}` ({attr.when})")
    head = "| Offset | Size | Type | Field | Fixed by | Meaning |"
    rule = "|---:|---:|---|---|---|---|"
    if views:
        head, rule = head + " Named accessors |", rule + "---|"
    out = [head, rule]
    for name, row in wire.rows(record):
        size = struct.calcsize("<" + row.fmt)
        kind = _TYPES.get(row.fmt, f"bytes[{size}]")
        line = (f"| {row.offset} | {size} | {kind} | {name} | "
                f"{'**seed**' if row.seed else 'ours'} | {row.meaning} |")
        out.append(line + (f" {'; '.join(views.get(name, [])) or '—'} |" if views else ""))
    return "\n".join(out) + "\n"


def doc_tables(doc: str) -> dict[str, tuple[int, int]]:
    """Where each generated table sits in the doc: name -> (start, end) offsets."""
    found, pos = {}, 0
    while (i := doc.find("<!-- table:", pos)) >= 0:
        name = doc[i + 11:doc.index(" ", i + 11)]
        start = doc.index("\n", i) + 1
        end = doc.index("<!-- /table -->", start)
        found[name] = (start, end)
        pos = end
    return found


def test_protocol_doc_tables_are_the_wire_tables() -> None:
    """docs/protocol.md carries exactly the tables aotx.wire's layouts derive from their
    rows (regenerate with ``python tests/unit/test_wire.py``)."""
    with open(DOCS) as f:
        doc = f.read()
    where = doc_tables(doc)
    assert set(where) == set(LAYOUTS)
    for name, (start, end) in where.items():
        assert doc[start:end] == layout_table(LAYOUTS[name]), name


def regenerate() -> None:
    with open(DOCS) as f:
        doc = f.read()
    for name, (start, end) in sorted(doc_tables(doc).items(), key=lambda x: -x[1][0]):
        doc = doc[:start] + layout_table(LAYOUTS[name]) + doc[end:]
    with open(DOCS, "w") as f:
        f.write(doc)


def test_header_rows_are_the_struct_and_every_accessor_reads_its_field() -> None:
    offsets = [f.offset for _, f in wire.HEADER_FIELDS]
    sizes = [struct.calcsize("<" + f.fmt) for _, f in wire.HEADER_FIELDS]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == 128
    seed_fixed = {8, 12, 40, 64, 72, 76, 80, 84, 88, 92, 96, 100}
    assert {f.offset for _, f in wire.HEADER_FIELDS if f.seed} == seed_fixed
    values = {name: i + 1 for i, name in enumerate(wire.Header._fields)}
    values["identity"] = b"i" * 16
    h = wire.Header(**values)
    views = [(attr.field, name) for name, attr in vars(wire.Header).items()
             if isinstance(attr, wire._View)]
    assert len(views) >= 16 and all(f in wire.Header._fields for f, _ in views)
    for field_name, view in views:
        assert getattr(h, view) == getattr(h, field_name), view
    # a header is a value: encoding and replying leave it as it was
    before = tuple(h)
    wire.encode_packet(h._replace(magic=wire.MAGIC, version=wire.VERSION, op=wire.Op.INFO,
                                  phase=0, finish=0, reason=0, cancel_requested=0), b"abc")
    h.reply(200, epoch=5)
    assert tuple(h) == before
    with pytest.raises(AttributeError):
        h.epoch = 3  # type: ignore[misc]


if __name__ == "__main__":
    regenerate()


def test_policy_values_and_every_status_position_are_the_seeds() -> None:
    """'State values are off=0, quiet=1, active=2, paused=3, stopped=4, error=5 and
    recording=6'; 'reason: quiet=0, foreground=1, paused=2, capacity=3, active=4 or
    disabled=5'; 'Actions are pause=1, resume=2, stop=3, review-on=4 and review-off=5';
    'eight 32-bit words: schema, ABI, mode, state, review-enabled, pending, active rows and
    result status'; 'Eleven 64-bit fields start at byte 32'; 'Byte 120 contains a 32-bit
    reason'; 'Bytes 124 through 159 are zero'."""
    assert [(s.name, s.value) for s in wire.PolicyState] == [
        ("OFF", 0), ("QUIET", 1), ("ACTIVE", 2), ("PAUSED", 3), ("STOPPED", 4), ("ERROR", 5),
        ("RECORDING", 6)]
    assert [(r.name, r.value) for r in wire.PolicyReason] == [
        ("QUIET", 0), ("FOREGROUND", 1), ("PAUSED", 2), ("CAPACITY", 3), ("ACTIVE", 4),
        ("DISABLED", 5)]
    assert [(a.name, a.value) for a in wire.PolicyAction] == [
        ("PAUSE", 1), ("RESUME", 2), ("STOP", 3), ("REVIEW_ON", 4), ("REVIEW_OFF", 5)]
    words = ["schema", "abi", "mode", "state", "review_enabled", "pending", "active_rows",
             "result_status"]
    wides = ["control_revision", "source_frontier", "completed", "interrupted", "refused",
             "decision", "saved_generation", "max_ns", "last_ns", "written_bytes",
             "result_bytes"]
    values = {name: 1000 + i for i, name in enumerate(words + wides)}
    values.update(state=wire.PolicyState.RECORDING, review_enabled=1)
    status = wire.PolicyStatus(**values, reason=wire.PolicyReason.DISABLED)
    data = wire.encode_policy_status(status)
    assert len(data) == 160
    for i, name in enumerate(words):
        assert struct.unpack_from("<I", data, 4 * i)[0] == values[name], name
    for i, name in enumerate(wides):
        assert struct.unpack_from("<Q", data, 32 + 8 * i)[0] == values[name], name
    assert struct.unpack_from("<I", data, 120)[0] == wire.PolicyReason.DISABLED
    assert data[124:] == bytes(36)
    for state in wire.PolicyState:
        for reason in wire.PolicyReason:
            again = wire.decode_policy_status(wire.encode_policy_status(
                status._replace(state=state, reason=reason)))
            assert (again.state, again.reason) == (state, reason)


embed_inputs = st.one_of(
    st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=8),
    st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8), min_size=1, max_size=8))


@given(embed_inputs)
def test_embed_inputs_roundtrip(inputs: list[str] | list[list[int]]) -> None:
    try:
        data = wire.encode_embed(inputs)
    except UnicodeEncodeError:  # a lone surrogate: the gateway refuses those first
        return
    back = wire.decode_embed(data)
    assert [b if isinstance(b, str) else list(b) for b in back] == list(inputs)


def test_embed_layout_is_the_documented_one() -> None:
    data = wire.encode_embed(["hi", [7, 1 << 31]])  # type: ignore[list-item]
    assert data == (struct.pack("<III", 2, 1, 2) + b"hi"
                    + struct.pack("<II", 2, 8) + struct.pack("<II", 7, 1 << 31))
    assert wire.decode_embed(data) == ["hi", (7, 1 << 31)]


@pytest.mark.parametrize("bad", [
    b"",  # no count
    struct.pack("<I", 0),  # no input
    struct.pack("<III", 1, 1, 0),  # an empty text
    struct.pack("<III", 1, 2, 0),  # an empty token array
    struct.pack("<III", 1, 2, 3) + b"abc",  # token bytes not a multiple of 4
    struct.pack("<III", 1, 3, 1) + b"a",  # unknown kind
    struct.pack("<III", 1, 1, 2) + b"\xff\xfe",  # not UTF-8
    struct.pack("<III", 1, 1, 9) + b"short",  # overruns
    struct.pack("<III", 1, 1, 1) + b"ab",  # trailing bytes
    struct.pack("<I", wire.MAX_EMBED_INPUTS + 1),  # too many
])
def test_embed_decoder_refuses_malformed_payloads(bad: bytes) -> None:
    with pytest.raises(WireError) as err:
        wire.decode_embed(bad)
    assert err.value.status == 400 and err.value.reason is wire.Reason.MALFORMED


def test_embed_encoder_refuses_more_than_a_packet() -> None:
    with pytest.raises(WireError) as err:
        wire.encode_embed(["x" * wire.MAX_PAYLOAD])
    assert err.value.status == 413 and err.value.reason is wire.Reason.TOO_LARGE


def test_embed_request_fields() -> None:
    ok = wire.Header.request(wire.Op.EMBED, principal=1, role=2, cursor=28,
                             identity=bytes(range(16)), wait_ms=28_000)
    wire.check_request(ok)
    with pytest.raises(WireError) as err:
        wire.check_request(ok._replace(temperature=1.0))
    assert err.value.reason is wire.Reason.NONZERO_FIELD and err.value.detail == 108
