"""WAITS (op 21): several WAITs of one connection in one packet, answered together
(docs/protocol.md, section 10.1), on a device with its real tables and mailboxes and a
scripted model."""

from __future__ import annotations

import time

import pytest

from aotx import wire
from aotx.device.runtime import Device
from aotx.engine.llama.scheduler import Scheduler

from .devices import call
from .test_device_protocol import text_submission

Pair = tuple[Device, Scheduler]


def _submit(dev: Device, script: list[int]) -> wire.Header:
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=len(script)),
                 text_submission())
    assert ah.status == 202
    dev.state.requests[ah.identity].script = script  # type: ignore[attr-defined]
    return ah


def _wait(dev: Device, ah: wire.Header, tag: int, cursor: int = 0,
          phase: wire.Phase = wire.Phase.QUEUED, wait_ms: int = 10_000) -> wire.Header:
    return wire.Header.request(wire.Op.WAIT, principal=7, epoch=dev.epoch, identity=ah.identity,
                               cursor=cursor, wait_ms=wait_ms, phase=int(phase), tag=tag)


def _group(dev: Device, members: list[wire.Header], mailbox: int = 2
           ) -> list[tuple[wire.Header, bytes]] | None:
    """Send a WAITS of ``members``: their replies, or None when the group parked."""
    h = wire.Header.request(wire.Op.WAITS, member_count=len(members), tag=77)
    with dev.state.lock:
        out = dev.respond(mailbox, h, wire.encode_waits(members))
    if out is None:
        return None
    rh, payload = out
    assert (rh.op, rh.status, rh.tag, rh.member_count) == (wire.Op.WAITS, 200, 77, len(members))
    return wire.decode_wait_replies(payload)


def _published(dev: Device, mailbox: int = 2) -> list[tuple[wire.Header, bytes]]:
    rh, payload = wire.decode_packet(dev.region.read(mailbox))
    assert (rh.op, rh.status, rh.tag) == (wire.Op.WAITS, 200, 77)
    return wire.decode_wait_replies(payload)


def test_a_group_parks_and_answers_every_member_in_one_reply(device: Pair) -> None:
    """Nothing new for any member: the group parks in one mailbox.  A step that gives
    both requests a byte answers both in one reply, each as a READ would, in order."""
    dev, sched = device
    a, b = _submit(dev, [1, 1, 1]), _submit(dev, [2, 2, 2])
    assert _group(dev, [_wait(dev, a, 10), _wait(dev, b, 11)]) is None
    assert dev.handlers.parked_waits == 2 and list(dev.waits.by_mailbox) == [2]
    while not all(dev.state.requests[r.identity].out for r in (a, b)):
        sched.step()
    with dev.state.lock:
        dev.waits.settle(time.monotonic())
    replies = _published(dev)
    assert [(h.tag, h.status, h.cursor, h.total) for h, _ in replies] == [
        (10, 200, 0, len(dev.state.requests[a.identity].out)),
        (11, 200, 0, len(dev.state.requests[b.identity].out))]
    assert all(body and len(body) == h.total for h, body in replies)
    assert dev.handlers.parked_waits == 0 and not dev.waits.by_mailbox
    assert not dev.waits.by_identity


def test_members_with_nothing_new_get_204_and_the_others_their_window(device: Pair) -> None:
    """One member has bytes, the other none: the group is answered at once; the one
    without gets 204 (wait again), not an empty window."""
    dev, sched = device
    a, b = _submit(dev, [1, 1, 1]), _submit(dev, [2, 2, 2])
    while not all(dev.state.requests[r.identity].out for r in (a, b)):
        sched.step()
    ra = dev.state.requests[a.identity]
    rb = dev.state.requests[b.identity]
    seen = _wait(dev, b, 11, cursor=len(rb.out), phase=rb.phase)
    replies = _group(dev, [_wait(dev, a, 10), seen])
    assert replies is not None
    (ha, body), (hb, none) = replies
    assert (ha.status, ha.tag, body) == (200, 10, bytes(ra.out))
    assert (hb.status, hb.tag, hb.payload_length, none) == (204, 11, 0, b"")
    assert dev.handlers.parked_waits == 0


def test_one_members_refusal_is_its_own_reply(device: Pair) -> None:
    """A member on an unknown handle gets its 404; the others are answered as usual."""
    dev, sched = device
    a = _submit(dev, [1, 1])
    sched.step()
    unknown = _wait(dev, a, 12)._replace(identity=b"\x09" * 16)
    replies = _group(dev, [unknown, _wait(dev, a, 10)])
    assert replies is not None
    assert [(h.tag, h.status, h.reason) for h, _ in replies] == [
        (12, 404, wire.Reason.NO_REQUEST), (10, 200, wire.Reason.NONE)]


def test_cancel_and_unpark_answer_a_parked_group(device: Pair) -> None:
    """UNPARK on one member's request answers the group now: that member as a READ, the
    other with 204 (it is still waiting for something new)."""
    dev, _ = device
    a, b = _submit(dev, [1, 1]), _submit(dev, [2, 2])
    assert _group(dev, [_wait(dev, a, 10), _wait(dev, b, 11)]) is None
    h, _ = call(dev, wire.Header(op=wire.Op.UNPARK, identity=b.identity))
    assert h.status == 200
    replies = _published(dev)
    assert [(rh.tag, rh.status) for rh, _ in replies] == [(10, 204), (11, 200)]
    assert dev.handlers.parked_waits == 0 and not dev.waits.by_identity


def test_two_members_on_one_request_are_answered_once_each(device: Pair) -> None:
    """Two readers of the same request in one group (and the request in a WAIT of its
    own beside it): a CANCEL answers every one of them, and nothing stays parked."""
    dev, _ = device
    a, b = _submit(dev, [1, 1]), _submit(dev, [2, 2])
    assert _group(dev, [_wait(dev, a, 10), _wait(dev, b, 11), _wait(dev, a, 12)]) is None
    alone = _wait(dev, a, 13)
    with dev.state.lock:
        assert dev.respond(3, alone, b"") is None
    assert dev.handlers.parked_waits == 4 and len(dev.waits.by_identity[a.identity]) == 2
    h, _ = call(dev, wire.Header(op=wire.Op.CANCEL, identity=a.identity))
    assert h.status == 202
    assert [(rh.tag, rh.status, rh.cancel_requested) for rh, _ in _published(dev)] == [
        (10, 200, 1), (11, 204, 0), (12, 200, 1)]
    single, _ = wire.decode_packet(dev.region.read(3))
    assert (single.tag, single.status, single.cancel_requested) == (13, 200, 1)
    assert dev.handlers.parked_waits == 0 and not dev.waits.by_identity
    assert not dev.waits.by_mailbox


def test_a_member_times_out_on_its_own_deadline(device: Pair) -> None:
    dev, _ = device
    a, b = _submit(dev, [1, 1]), _submit(dev, [2, 2])
    assert _group(dev, [_wait(dev, a, 10, wait_ms=60_000), _wait(dev, b, 11, wait_ms=1)]) is None
    with dev.state.lock:
        assert dev.waits.next_deadline(time.monotonic(), 1.0) <= 0.001
        dev.waits.settle(time.monotonic() + 0.01)
    replies = _published(dev)
    assert [(rh.tag, rh.status) for rh, _ in replies] == [(10, 204), (11, 200)]


def test_windows_share_the_packet(device: Pair) -> None:
    """Each member's window is at most its share of one packet, so the reply fits it."""
    dev, sched = device
    dev.state.limits.window_bytes = 1 << 20
    reqs = [_submit(dev, [1] * 40) for _ in range(2)]
    while sched.step():
        pass
    big = b"x" * 5000
    for ah in reqs:
        dev.state.requests[ah.identity].out[:] = big
    members = [_wait(dev, reqs[i % 2], 100 + i) for i in range(wire.WAITS_MAX)]
    replies = _group(dev, members)
    assert replies is not None
    share = wire.waits_share(wire.WAITS_MAX)
    assert all(h.status == 200 and body == big[:share] and h.total == len(big)
               for h, body in replies)


@pytest.mark.parametrize("count, member", [
    (0, None), (wire.WAITS_MAX + 1, None), (1, "read"), (1, "flags"), (2, "short")])
def test_a_malformed_group_is_refused_whole(device: Pair, count: int, member: str | None
                                            ) -> None:
    dev, _ = device
    m = wire.Header.request(wire.Op.WAIT, principal=7, epoch=dev.epoch, identity=b"\x01" * 16)
    if member == "read":
        m = m._replace(op=wire.Op.READ)
    elif member == "flags":
        m = m._replace(flags=wire.READ_FLAG_ANNOTATIONS)
    payload = wire.encode_waits([m] * (count - (member == "short")))
    h = wire.Header.request(wire.Op.WAITS, member_count=count, tag=3)
    with dev.state.lock:
        out = dev.respond(2, h, payload)
    assert out is not None
    assert (out[0].status, out[0].reason, out[0].tag) == (400, wire.Reason.MALFORMED, 3)
    assert not dev.waits.by_mailbox
