"""Device layer: media leases from admission to the terminal state (fake engine, real tables).

These tests give the device a scripted image-capable model (a fake projector
that turns each media marker into two placeholder positions) to check the
lease rules themselves; tests/e2e/test_e2e_vision.py runs the real projector.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from aotx import wire
from aotx.device.runtime import Device
from aotx.engine.multimodal import MediaSegment

from ..helpers import png
from .devices import FakeEncoder, call


def test_a_request_leases_its_sources_until_terminal(device) -> None:
    dev, sched = device
    img = png(3)
    rh, body = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"u" * 16, role=1,
                                     flags=wire.MEDIA_FLAG_FINAL), img)
    assert rh.status == 201
    source_id, digest = rh.identity, wire.decode_media_meta(body[:64]).digest
    sub = wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.TEXT, b"look: "), wire.Part(wire.PartKind.IMAGE_DIGEST, digest),
        wire.Part(wire.PartKind.TEXT, b"?"))),)))
    ah, _ = call(dev, wire.Header(op=wire.Op.SUBMIT, role=1, limit=5), sub)
    assert ah.status == 202
    req = dev.state.requests[ah.identity]
    assert req.media == [img]
    meta = wire.decode_media_meta(call(dev, wire.Header(op=wire.Op.MEDIA_READ,
                                                        identity=source_id))[1][:64])
    assert meta.leases == 1
    dh, msg = call(dev, wire.Header(op=wire.Op.MEDIA_DELETE, identity=source_id))
    assert dh.status == 409 and dh.reason == wire.Reason.LEASED and dh.detail == 1
    assert msg == b""  # no text crosses the wire: the gateway words the reason
    req.script = [1, 1, 1]  # type: ignore[attr-defined]
    while sched.step():
        pass
    assert req.phase is wire.Phase.COMPLETED
    meta = wire.decode_media_meta(call(dev, wire.Header(op=wire.Op.MEDIA_READ,
                                                        identity=source_id))[1][:64])
    assert meta.leases == 0
    assert call(dev, wire.Header(op=wire.Op.MEDIA_DELETE, identity=source_id))[0].status == 200
    # a digest that is not a ready source of the caller is 404
    gone, _ = call(dev, wire.Header(op=wire.Op.SUBMIT, role=1, limit=5), sub)
    assert gone.status == 404


def test_bytes_held_already_are_refused_under_a_type_they_are_not(device) -> None:
    """A PNG uploaded again as image/jpeg is refused as new bytes would be (it answered
    200 with the PNG source), and as image/png it is the same source again."""
    dev, _ = device
    img = png(5)
    first, _ = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"p" * 16, role=1,
                                     flags=wire.MEDIA_FLAG_FINAL), img)
    assert first.status == 201
    as_jpeg, body = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"q" * 16, role=2,
                                          flags=wire.MEDIA_FLAG_FINAL), img)
    meta = wire.decode_media_meta(body[:64])
    assert as_jpeg.status == 201 and as_jpeg.identity != first.identity
    assert meta.state == wire.MediaState.REFUSED
    again, _ = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"r" * 16, role=1,
                                     flags=wire.MEDIA_FLAG_FINAL), img)
    assert (again.status, again.identity) == (200, first.identity)


def test_cancelled_request_releases_its_lease(device) -> None:
    dev, sched = device
    rh, body = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"v" * 16, role=1,
                                     flags=wire.MEDIA_FLAG_FINAL), png(4))
    digest = wire.decode_media_meta(body[:64]).digest
    sub = wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.IMAGE_DIGEST, digest),)),)))
    ends_in_image, msg = call(dev, wire.Header(op=wire.Op.SUBMIT, role=1, limit=50), sub)
    assert ends_in_image.status == 400 and ends_in_image.reason == wire.Reason.MEDIA_LAST
    assert dev.state.media.sources[rh.identity].leases == 0  # a refusal leases nothing
    sub = wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.IMAGE_DIGEST, digest), wire.Part(wire.PartKind.TEXT, b"?"))),)))
    ah, _ = call(dev, wire.Header(op=wire.Op.SUBMIT, role=1, limit=50), sub)
    dev.state.requests[ah.identity].script = [1] * 50  # type: ignore[attr-defined]
    sched.step()
    call(dev, wire.Header(op=wire.Op.CANCEL, identity=ah.identity))
    sched.step()
    assert dev.state.requests[ah.identity].phase is wire.Phase.CANCELLED
    assert dev.state.media.sources[rh.identity].leases == 0


def test_a_lost_doorbell_delays_a_packet_by_a_second_at_most(device) -> None:
    """A request published without a ring (as when a full FIFO drops it) is still answered."""
    import threading
    import time

    from aotx.mailbox import REPLY, REQUEST

    dev, _sched = device
    t = threading.Thread(target=dev.serve, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        dev.region.publish(1, wire.encode_packet(wire.Header(op=wire.Op.INFO, tag=5)), REQUEST)
        deadline = time.monotonic() + 3
        while dev.region.state(1) != REPLY:
            assert time.monotonic() < deadline, "the device never looked at the mailbox"
            time.sleep(0.05)
        h, body = wire.decode_packet(dev.region.read(1))
        assert h.status == 200 and h.tag == 5 and wire.decode_info(body).epoch == dev.epoch
    finally:
        dev.stop()
        t.join(10)


def test_ephemeral_sources_go_with_their_last_lease() -> None:
    """Inline media (MEDIA_FLAG_EPHEMERAL): leased like any source, never listed, removed
    when the last request holding it ends, or by the sweep if no request ever leased it."""
    from aotx.device.media import EPHEMERAL_SECONDS, MediaTable

    t = MediaTable(1 << 20, 1 << 24, 1 << 24)
    g = wire.Grant(principal=7, actions=int(wire.Action.all()), model_mask=2, revision=1)

    def put(data: bytes, ephemeral: bool = True) -> tuple[int, object]:
        return t.put(7, secrets.token_bytes(16), 0, 1, data, True, False, g, ephemeral=ephemeral)

    status, src = put(png(1))
    assert status == 201 and src.ephemeral and t.page(7, 0, 10)[0] == []
    t.lease(src)
    again_status, again = put(png(1))  # the same bytes inline for a second request
    assert again_status == 200 and again is src and src.claims == 1
    t.unlease(src.id)  # the first request ends; the second has not leased yet
    assert src.id in t.sources
    t.lease(src)
    t.unlease(src.id)  # the second ends: nothing holds it any more
    assert src.id not in t.sources and t.total_bytes == 0
    _, lone = put(png(2))  # uploaded inline, but its request was refused
    t.sweep(time.monotonic() + EPHEMERAL_SECONDS / 2)
    assert lone.id in t.sources
    t.sweep(time.monotonic() + EPHEMERAL_SECONDS + 1)
    assert lone.id not in t.sources and t.total_bytes == 0
    _, kept = put(png(3))
    status, named = put(png(3), ephemeral=False)  # uploaded by name: an ordinary source
    assert named is kept and not kept.ephemeral
    t.sweep(time.monotonic() + EPHEMERAL_SECONDS + 1)
    assert [s.id for s in t.page(7, 0, 10)[0]] == [kept.id]


def test_media_is_checked_before_libmtmd_sees_it() -> None:
    """Only formats the bundled decoders read, and images small enough to decode."""
    import struct as st

    from aotx.engine.multimodal import MAX_PIXELS, MediaInputError, check_media, image_size

    assert image_size(png(1, 24)) == ("png", 24, 24)
    assert image_size(b"GIF89a" + st.pack("<HH", 640, 480) + b"\0" * 8) == ("gif", 640, 480)
    jpeg = (b"\xff\xd8" + b"\xff\xe0" + st.pack(">H", 16) + b"JFIF\0" + b"\0" * 9
            + b"\xff\xdb" + st.pack(">H", 4) + b"\0\0"
            + b"\xff\xc2" + st.pack(">HBHH", 17, 8, 1080, 1920) + b"\0" * 12)
    assert image_size(jpeg) == ("jpeg", 1920, 1080)
    webp = b"RIFF" + st.pack("<I", 30) + b"WEBPVP8 " + b"\0" * 20
    for kind, data, words in [
        ("image", webp, "only PNG, JPEG and GIF"),
        ("image", b"\x89PNG\r\n\x1a\n" + st.pack(">I", 13) + b"IHDR" + st.pack(">II", 5000, 5000),
         f"at most {MAX_PIXELS} pixels"),
        ("image", b"\x89PNG\r\n\x1a\n" + st.pack(">I", 13) + b"IHDR" + st.pack(">II", 0, 10),
         "0x10"),
        ("audio", b"OggS" + b"\0" * 40, "only WAV, MP3 and FLAC"),
    ]:
        with pytest.raises(MediaInputError, match=words):
            check_media(kind, data, 0)
    check_media("image", png(2, 16), 0)
    check_media("image", jpeg, 0)
    # stb_image reads 0xFF 0xFF as a fill byte before a marker, not as a marker: the
    # frame header right after it is the real size (here far over the limit).
    filled = (b"\xff\xd8\xff\xff\xc0" + st.pack(">HBHH", 17, 8, 26000, 26000) + b"\0" * 12
              + b"\xff\xc0" + st.pack(">HBHH", 17, 8, 1, 1) + b"\0" * 12)
    assert image_size(filled) == ("jpeg", 26000, 26000)
    with pytest.raises(MediaInputError, match="pixels"):
        check_media("image", filled, 0)


def _wav(rate: int, data: bytes) -> bytes:
    import struct as st

    return (b"RIFF" + st.pack("<I", 36 + len(data)) + b"WAVEfmt "
            + st.pack("<IHHIIHH", 16, 1, 1, rate, rate, 1, 8) + b"data"
            + st.pack("<I", len(data)) + data)


def _flac(rate: int, total: int) -> bytes:
    x = (rate << 44) | (1 << 41) | (15 << 36) | total  # stereo, 16 bits
    return (b"fLaC" + bytes([0x80, 0, 0, 34]) + bytes(10) + x.to_bytes(8, "big")
            + bytes(16) + b"\xff\xf8" + bytes(30))


def test_audio_headers_bound_what_is_decoded() -> None:
    """Audio is decoded whole at the projector's rate: a 1 Hz WAV would grow 16,000-fold,
    a FLAC header may claim 2^36 samples; both, and over-long audio, are refused."""
    from aotx.engine.multimodal import MAX_AUDIO_SECONDS, MediaInputError, check_media

    check_media("audio", _wav(8000, bytes(8000)), 0)
    check_media("audio", _flac(44100, 44100 * 30), 0)
    for data, words in [
        (_wav(1, bytes(100)), "sample rate of 1 Hz"),
        (_wav(8000, bytes(8000 * (MAX_AUDIO_SECONDS + 1))), "at most"),
        (_flac(44100, (1 << 36) - 1), "at most"),
        (_flac(44100, 0), "unstated"),
        (_flac(0, 100), "sample rate"),
        (b"RIFF" + bytes(4) + b"WAVEjunk", "no readable header"),
    ]:
        with pytest.raises(MediaInputError, match=words):
            check_media("audio", data, 0)


class GatedEncoder(FakeEncoder):
    """Holds each tokenize until released, as a large image's preprocessing does."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.closed_while_busy = False
        self.busy = False

    def tokenize_media(self, kind: str, data: bytes,
                       n: int) -> tuple[list[int], list[MediaSegment]]:
        self.busy = True
        self.entered.set()
        assert self.release.wait(10)
        try:
            return super().tokenize_media(kind, data, n)
        finally:
            self.busy = False

    def close(self) -> None:
        self.closed_while_busy |= self.busy


def _submit_through_worker(dev: Device, encoder: GatedEncoder) -> tuple[bytes, threading.Thread]:
    """Serve the device, put an image source, publish a SUBMIT that uses it; return
    (the source's id, the serving thread) once the media worker is inside the encoder."""
    from aotx.mailbox import REQUEST

    dev.state.models[1].encoder = encoder  # type: ignore[assignment]
    rh, body = call(dev, wire.Header(op=wire.Op.MEDIA_PUT, identity=b"w" * 16, role=1,
                                     flags=wire.MEDIA_FLAG_FINAL), png(5))
    digest = wire.decode_media_meta(body[:64]).digest
    serving = threading.Thread(target=dev.serve, daemon=True)
    serving.start()
    sub = wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
        wire.Part(wire.PartKind.IMAGE_DIGEST, digest), wire.Part(wire.PartKind.TEXT, b"?"))),)))
    h = wire.Header(op=wire.Op.SUBMIT, role=1, limit=5, principal=7, tag=9)
    dev.region.publish(1, wire.encode_packet(h, sub), REQUEST)
    dev.bell.ring_self(1)
    assert encoder.entered.wait(5), "the media worker never started the request"
    return rh.identity, serving


def test_a_grant_revoked_while_media_is_prepared_refuses_the_request(device) -> None:
    """The media worker prepares without the lock; the admission afterwards checks the
    grant installed then, not the one seen when the packet arrived."""
    from aotx.mailbox import REPLY

    dev, _sched = device
    encoder = GatedEncoder()
    source_id, serving = _submit_through_worker(dev, encoder)
    try:
        with dev.state.lock:
            dev.state.grants[7] = wire.Grant(principal=7, actions=0, model_mask=0, revision=2)
        encoder.release.set()
        deadline = time.monotonic() + 5
        while dev.region.state(1) != REPLY:
            assert time.monotonic() < deadline, "no reply"
            time.sleep(0.02)
        h, msg = wire.decode_packet(dev.region.read(1))
        assert h.status == 403 and h.tag == 9, (h.status, h.reason)
        assert not dev.state.requests
        assert dev.state.media.sources[source_id].leases == 0  # the refusal gave the lease back
    finally:
        encoder.release.set()
        dev.stop()
        serving.join(10)


def test_shutdown_waits_for_the_media_worker_before_closing_the_encoder(device) -> None:
    """A stop while the worker is inside the encoder: the encoder is closed only after
    the worker left it (libmtmd's context freed under a running preprocess would crash)."""
    dev, _sched = device
    encoder = GatedEncoder()
    _, serving = _submit_through_worker(dev, encoder)
    timer = threading.Timer(0.3, encoder.release.set)
    timer.start()
    dev.stop()
    serving.join(10)
    assert not serving.is_alive()
    assert encoder.release.is_set() and not encoder.closed_while_busy


def test_grant_rows_are_read_a_page_at_a_time(device) -> None:
    """GRANT_READ answers the rows of principals >= cursor, GRANT_PAGE at most."""
    dev, _sched = device
    rows = [wire.Grant(principal=pid, actions=1, model_mask=2) for pid in range(100, 1600)]
    for i in range(0, len(rows), 1000):
        chunk = rows[i:i + 1000]
        h, _ = call(dev, wire.Header(op=wire.Op.GRANT_INSTALL, total=len(chunk)),
                    wire.encode_grants(chunk))
        assert h.status == 200
    seen: list[int] = []
    cursor = 0
    while True:
        h, body = call(dev, wire.Header(op=wire.Op.GRANT_READ, cursor=cursor))
        page = wire.decode_grants(body, h.total)
        seen += [g.principal for g in page]
        if len(page) < wire.GRANT_PAGE:
            break
        cursor = page[-1].principal + 1
    assert seen == [7] + list(range(100, 1600))  # the fixture's principal 7 first


def test_a_failing_policy_tick_does_not_stop_the_device(device) -> None:
    """The automatic-memory policy saves files from the control loop; a disk error
    there is logged, and mailboxes are still answered."""
    from aotx.mailbox import REPLY, REQUEST

    dev, _sched = device
    ticks = []

    def failing_tick() -> None:
        ticks.append(1)
        raise OSError(28, "No space left on device")

    dev.policy_tick = failing_tick  # type: ignore[method-assign]
    serving = threading.Thread(target=dev.serve, daemon=True)
    serving.start()
    try:
        dev.region.publish(1, wire.encode_packet(wire.Header(op=wire.Op.INFO, tag=3)), REQUEST)
        dev.bell.ring_self(1)
        deadline = time.monotonic() + 5
        while dev.region.state(1) != REPLY:
            assert time.monotonic() < deadline, "the device stopped answering"
            time.sleep(0.02)
        assert wire.decode_packet(dev.region.read(1))[0].status == 200 and ticks
        assert serving.is_alive()
    finally:
        dev.stop()
        serving.join(10)


def test_parallel_uploads_share_the_grant_and_refused_rows_are_bounded() -> None:
    """Uploads in progress count against the grant's sources and bytes (started
    together, each would otherwise get the whole allowance); refused sources (kept
    for their reason) are bounded per principal."""
    from aotx.device.errors import DeviceError
    from aotx.device.media import MAX_REFUSED, MediaTable

    t = MediaTable(1 << 20, 1 << 24, 1 << 24)
    g = wire.Grant(principal=7, actions=int(wire.Action.all()), model_mask=2, revision=1,
                   max_media_bytes=100)
    assert t.put(7, b"a" * 16, 0, 1, b"\x89PNG" + bytes(56), False, False, g)[0] == 202
    with pytest.raises(DeviceError) as err:
        t.put(7, b"b" * 16, 0, 1, b"\x89PNG" + bytes(56), False, False, g)
    assert err.value.status == 413
    one = wire.Grant(principal=8, actions=int(wire.Action.all()), model_mask=2, revision=1,
                     max_media_sources=1)
    assert t.put(8, b"c" * 16, 0, 1, b"\x89PNG", False, False, one)[0] == 202
    with pytest.raises(DeviceError) as err:
        t.put(8, b"d" * 16, 0, 1, b"\x89PNG", False, False, one)
    assert (err.value.reason, err.value.detail) == (wire.Reason.SOURCE_COUNT, 1)  # 1 source
    for _ in range(3 * MAX_REFUSED):
        status, src = t.put(9, secrets.token_bytes(16), 0, 1, b"", True, False, g)
        assert status == 201 and src is not None and src.state is wire.MediaState.REFUSED
    assert sum(s.principal == 9 for s in t.sources.values()) == MAX_REFUSED
