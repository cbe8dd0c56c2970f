"""What one principal can do to another, as the device enforces it (a scripted model;
tests/e2e/test_e2e_isolation.py runs the same rules on the real service): shares of the
active requests and the media pool, retention per principal, revocation that stops
work, the admin's cancel, and UNPARK."""

from __future__ import annotations

import time

from aotx import wire
from aotx.device.media import MediaTable
from aotx.device.runtime import Device
from aotx.engine.llama.scheduler import Scheduler

from .devices import call
from .test_device_protocol import text_submission

Pair = tuple[Device, Scheduler]


def as_principal(dev: Device, principal: int, h: wire.Header,
                 payload: bytes = b"") -> tuple[wire.Header, bytes]:
    """``h`` from ``principal`` (devices.call is always principal 7)."""
    used = wire.REQUEST_FIELDS[wire.Op(h.op)]
    h = h._replace(principal=principal, epoch=dev.epoch if "epoch" in used else 0)
    with dev.state.lock:
        out = dev.respond(0, h, payload)
    assert out is not None
    return out


def grant(dev: Device, principal: int, **limits: int) -> None:
    row = wire.Grant(principal=principal, actions=int(wire.Action.SUBMIT | wire.Action.READ
                                                       | wire.Action.CANCEL | wire.Action.MEDIA),
                     model_mask=2, **limits)
    h, _ = call(dev, wire.Header(op=wire.Op.GRANT_INSTALL, total=1), wire.encode_grants([row]))
    assert h.status == 200


def submit(dev: Device, principal: int) -> wire.Header:
    h = as_principal(dev, principal, wire.Header.request(wire.Op.SUBMIT, role=1, max_tokens=3),
                     text_submission())[0]
    if h.status == 202:
        dev.state.requests[h.identity].script = [1]  # type: ignore[attr-defined]
    return h


def test_a_principal_holds_at_most_its_share_of_the_active_requests(device: Pair) -> None:
    dev, _ = device
    dev.state.limits.max_active = 12
    grant(dev, 20)
    grant(dev, 21, max_active=2)
    got = [submit(dev, 20) for _ in range(7)]
    assert [h.status for h in got] == [202] * 6 + [429]
    # the refusal names the principal's own limit (half of 12), not the device's load
    assert (got[-1].reason, got[-1].detail) == (wire.Reason.ACTIVE_LIMIT, 6)
    assert [submit(dev, 7).status for _ in range(2)] == [202, 202]  # another still gets in
    # a grant's max_active is that principal's share
    assert [(h.status, h.detail) for h in (submit(dev, 21) for _ in range(3))][-1] == (429, 2)


def test_retention_counts_each_principals_results_apart(device: Pair) -> None:
    dev, sched = device
    dev.state.limits.retention_requests = 3
    grant(dev, 20)
    mine = submit(dev, 7)
    for _ in range(3):  # principal 20 ends many requests: its own oldest go, not 7's
        for _ in range(3):
            submit(dev, 20)
        while sched.step():
            pass
        dev.state.reclaim(time.monotonic_ns())
    assert mine.identity in dev.state.requests
    assert sum(1 for r in dev.state.requests.values() if r.principal == 20) == 3


def test_reinstalling_a_principals_grant_cancels_its_requests(device: Pair) -> None:
    """A revoked token (a row with no actions) or a replaced grant: nobody can read the
    requests admitted under the old revision, so they stop."""
    dev, _ = device
    grant(dev, 20)
    theirs = [submit(dev, 20) for _ in range(3)]
    mine = submit(dev, 7)
    revoked = wire.Grant(principal=20)
    call(dev, wire.Header(op=wire.Op.GRANT_INSTALL, total=1), wire.encode_grants([revoked]))
    reqs = dev.state.requests
    assert all(reqs[h.identity].cancel_requested for h in theirs)
    assert not reqs[mine.identity].cancel_requested


def test_only_an_admin_cancels_another_principals_request(device: Pair) -> None:
    dev, _ = device
    grant(dev, 20)
    theirs = submit(dev, 20)
    plain = wire.Header(op=wire.Op.CANCEL, identity=theirs.identity)
    admin = plain._replace(flags=wire.CANCEL_FLAG_ADMIN)
    assert call(dev, plain)[0].status == 404  # principal 7's own view: no such request
    assert as_principal(dev, 20, admin)[0].reason == wire.Reason.ACTION  # 20 is no admin
    h, _ = call(dev, admin)  # principal 7 holds every action, admin included
    assert h.status == 202 and dev.state.requests[theirs.identity].cancel_requested
    assert call(dev, admin._replace(identity=bytes(16)))[0].status == 404


def test_unpark_answers_the_callers_parked_waits_at_once(device: Pair) -> None:
    dev, _ = device
    ah = submit(dev, 7)
    wait = wire.Header.request(wire.Op.WAIT, principal=7, epoch=dev.epoch, identity=ah.identity,
                               wait_ms=60_000, phase=int(wire.Phase.QUEUED), tag=4)
    with dev.state.lock:
        assert dev.respond(2, wait, b"") is None  # parked
    grant(dev, 20)
    foreign = as_principal(dev, 20, wire.Header(op=wire.Op.UNPARK, identity=ah.identity))[0]
    assert foreign.status == 404 and dev.handlers.parked_waits == 1
    h, _ = call(dev, wire.Header(op=wire.Op.UNPARK, identity=ah.identity))
    assert h.status == 200 and dev.handlers.parked_waits == 0 and not dev.waits.by_mailbox
    answered, _ = wire.decode_packet(dev.region.read(2))
    assert (answered.status, answered.tag) == (200, 4)


def test_media_refusals_name_the_limit_that_was_reached() -> None:
    """A source too large, a principal over its share, the pool full: three answers."""
    t = MediaTable(max_source_bytes=100, max_total_bytes=250, share_bytes=150)
    g = wire.Grant(principal=1, actions=int(wire.Action.MEDIA))
    png = b"\x89PNG\r\n\x1a\n"

    def put(principal: int, uid: int, size: int) -> tuple[int, wire.Reason, int]:
        try:
            status, _ = t.put(principal, bytes([uid]) * 16, 0, 1, png + bytes(size - 8), True,
                              False, g._replace(principal=principal))
        except Exception as exc:  # DeviceError
            return exc.status, exc.reason, exc.detail  # type: ignore[attr-defined]
        return status, wire.Reason.NONE, 0

    assert put(1, 1, 101) == (413, wire.Reason.SOURCE_BYTES, 100)
    assert put(1, 2, 100)[0] == 201
    assert put(1, 3, 60) == (413, wire.Reason.MEDIA_SHARE, 150)  # 160 > its 150
    assert put(2, 4, 100)[0] == 201
    assert put(3, 5, 60) == (507, wire.Reason.MEDIA_POOL, 0)  # 260 > the pool's 250
    assert t.total_bytes == 200
