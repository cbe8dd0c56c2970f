"""The control loop's housekeeping on demand (device/runtime.py, ``Device._pass``): a
pass woken by a step's end or by a stream's READs and WAITs answers them and leaves the
loads, the folder watcher, the policy and the embedding deadlines alone until something
asks (``Device.wake``, a request of another kind) or ``QUIET_PASS_S`` has passed."""

from __future__ import annotations

from aotx import wire
from aotx.device.runtime import QUIET_PASS_S, Device, start_timers
from aotx.mailbox import REPLY, REQUEST

from .devices import scripted_device


def _pass(dev: Device, timers: dict[str, float], header: wire.Header | None = None) -> None:
    """One pass, with ``header`` (principal 7's) in mailbox 0 as the broker leaves it;
    its reply is taken back, as the broker does."""
    pending = []
    if header is not None:
        dev.region.publish(0, wire.encode_packet(header._replace(principal=7)), REQUEST)
        pending = [0]
    with dev.state.lock:
        dev._pass(pending, timers)
    if header is not None:
        assert dev.region.state(0) == REPLY
        dev.region.release(0)


def test_a_streams_passes_skip_the_housekeeping_until_something_asks() -> None:
    with scripted_device() as (dev, _):
        runs: list[str] = []
        dev._on_demand = lambda: runs.append("housekeeping")  # type: ignore[method-assign]
        timers = start_timers()
        _pass(dev, timers)  # start-up
        assert runs == ["housekeeping"]
        read = wire.Header(op=wire.Op.READ, epoch=dev.epoch, identity=bytes(16))
        _pass(dev, timers)  # a step's end
        _pass(dev, timers, read)  # a stream's READ (404 here: no such request)
        assert runs == ["housekeeping"]
        dev.wake()  # (a handler, the loader, the watcher, a request's end)
        _pass(dev, timers)
        assert runs == ["housekeeping"] * 2
        _pass(dev, timers, wire.Header(op=wire.Op.INFO))  # another kind of request
        assert runs == ["housekeeping"] * 3
        _pass(dev, timers, read)
        assert runs == ["housekeeping"] * 3
        timers["full"] -= QUIET_PASS_S  # the last one was that long ago
        _pass(dev, timers)
        assert runs == ["housekeeping"] * 4
        _pass(dev, timers)
        timers["embeds_due"] = 0.0  # an embedding call's deadline passed
        _pass(dev, timers)
        assert runs == ["housekeeping"] * 5


def test_a_request_that_ends_asks_for_the_housekeeping() -> None:
    """Its model may be idle now: an unload asked, a load waiting for room."""
    with scripted_device() as (dev, sched):
        timers = start_timers()
        _pass(dev, timers)
        assert not dev._full
        sub = wire.encode_submission(wire.Submission((wire.Message(wire.Role.USER, (
            wire.Part(wire.PartKind.TEXT, b"hi"),)),)))
        h = wire.Header.request(wire.Op.SUBMIT, principal=7, role=1, max_tokens=2)
        dev.region.publish(0, wire.encode_packet(h, sub), REQUEST)
        with dev.state.lock:
            dev._pass([0], timers)
        ah = wire.decode_packet(dev.region.read(0))[0]
        assert ah.status == 202
        dev.region.release(0)
        dev.state.requests[ah.identity].script = [101]  # type: ignore[attr-defined]
        assert not dev._full  # (the submission asked, and that pass did it)
        while sched.queue or sched.active:
            sched.step()
        assert dev._full
