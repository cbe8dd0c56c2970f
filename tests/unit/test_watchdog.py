"""The supervisor's health check of the device: the hang rule alone, then the watch
over a real SEQPACKET socket with a scripted broker, on a simulated clock."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator

import pytest

from aotx import wire
from aotx.watchdog import MIN_MISSES, DeviceWatch, HangRule, Outcome

from ..helpers import short_tmpdir


# -- the rule ---------------------------------------------------------------------------------
def test_silence_counts_only_once_the_device_has_answered() -> None:
    rule = HangRule(hang_seconds=10)
    for t in range(0, 60, 3):  # loading: no answer yet, nothing counts
        rule.observe(Outcome.SILENT, t)
    assert not rule.hung(60) and rule.misses == 0
    rule.observe(Outcome.ANSWERED, 60)
    for t in (63, 66, 69):
        rule.observe(Outcome.SILENT, t)
    assert rule.misses == MIN_MISSES and not rule.hung(72.9)  # 9.9 s of silence
    assert rule.hung(73) and rule.silent_for(73) == 10


def test_an_answer_or_an_unknown_check_ends_the_streak() -> None:
    for ending in (Outcome.ANSWERED, Outcome.UNKNOWN):
        rule = HangRule(hang_seconds=10, answered=True)
        for t in (0, 3, 6, 9):
            rule.observe(Outcome.SILENT, t)
        assert rule.hung(12)
        rule.observe(ending, 12)
        assert not rule.hung(100) and rule.silent_since is None
        rule.observe(Outcome.SILENT, 15)  # a new streak starts from its own first check
        assert rule.silent_since == 15 and not rule.hung(24)


def test_a_long_silence_needs_several_checks() -> None:
    rule = HangRule(hang_seconds=10, answered=True)
    rule.observe(Outcome.SILENT, 0)  # one check that waited long (a stalled supervisor)
    assert not rule.hung(60)


# -- the watch over a socket ----------------------------------------------------------------------
class ScriptedBroker:
    """service.sock with a scripted device behind it: ``device`` answers INFO
    ("answers"), keeps it ("silent") or every mailbox is taken ("full"); ``stats``:
    whether the broker answers BROKER_STATS itself."""

    def __init__(self, path: str) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.srv.bind(path)
        self.srv.listen(4)
        self.srv.setblocking(False)
        self.conn: socket.socket | None = None
        self.device = "answers"
        self.stats = True
        self.epoch = 1
        self.replies = 0  # the broker's reply counter
        self.infos: list[wire.Header] = []

    def serve(self) -> None:
        try:
            conn, _ = self.srv.accept()
            conn.setblocking(False)
            self.conn = conn
        except BlockingIOError:
            pass
        while self.conn is not None:
            try:
                data = self.conn.recv(wire.MAX_PACKET + 1)
            except BlockingIOError:
                return
            h, _ = wire.decode_packet(data)
            if h.op == wire.Op.BROKER_STATS and self.stats:
                body = json.dumps({"replies": self.replies, "free": 3}).encode()
                self.conn.send(wire.encode_packet(h.reply(200), body))
            elif h.op == wire.Op.INFO:
                self.infos.append(h)
                if self.device == "answers":
                    self.answer(h)
                elif self.device == "full":
                    self.conn.send(wire.encode_packet(h.refuse(503, wire.Reason.NO_MAILBOX)))

    def answer(self, h: wire.Header) -> None:
        assert self.conn is not None
        self.replies += 1
        self.conn.send(wire.encode_packet(h.reply(200, epoch=self.epoch)))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.srv.close()


@pytest.fixture
def rig() -> Iterator[tuple[DeviceWatch, ScriptedBroker]]:
    state = short_tmpdir()
    path = os.path.join(state, "service.sock")
    broker = ScriptedBroker(path)
    watch = DeviceWatch(path, hang_seconds=10)
    try:
        yield watch, broker
    finally:
        watch.close()
        broker.close()
        shutil.rmtree(state, ignore_errors=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def run(self, watch: DeviceWatch, broker: ScriptedBroker, seconds: float) -> float | None:
        """Tick every 0.1 s for ``seconds``; the time the watch calls the device hung."""
        end = self.now + seconds
        while self.now < end:
            if watch.tick(self.now):
                return self.now
            broker.serve()
            self.now = round(self.now + 0.1, 1)
        return None


def test_a_device_that_stops_answering_is_hung_after_about_ten_seconds(
        rig: tuple[DeviceWatch, ScriptedBroker]) -> None:
    watch, broker = rig
    clock = Clock()
    assert clock.run(watch, broker, 30) is None and watch.rule.answered
    broker.device = "silent"
    stopped = clock.now
    hung = clock.run(watch, broker, 30)
    assert hung is not None and 10 <= hung - stopped <= 10 + 2 + 0.5, hung - stopped
    assert watch.rule.misses >= MIN_MISSES


def test_no_verdict_before_the_first_answer_and_one_packet_meanwhile(
        rig: tuple[DeviceWatch, ScriptedBroker]) -> None:
    """A loading device is not hung; the watch keeps one INFO waiting for it rather than
    one per check (each would hold a mailbox until the device answers)."""
    watch, broker = rig
    clock = Clock()
    broker.device = "silent"
    assert clock.run(watch, broker, 60) is None
    assert len(broker.infos) == 1 and not watch.rule.answered
    broker.answer(broker.infos[0])  # the device has loaded: it answers the waiting INFO
    broker.device = "answers"
    assert clock.run(watch, broker, 5) is None and watch.rule.answered


def test_a_silent_broker_is_not_a_hung_device(rig: tuple[DeviceWatch, ScriptedBroker]) -> None:
    watch, broker = rig
    clock = Clock()
    clock.run(watch, broker, 5)
    broker.device, broker.stats = "silent", False  # the broker itself stopped answering
    assert clock.run(watch, broker, 60) is None
    broker.stats = True
    assert clock.run(watch, broker, 20) is not None  # the broker relays; the device is silent


def test_full_mailboxes_count_as_alive_while_the_device_replies(
        rig: tuple[DeviceWatch, ScriptedBroker]) -> None:
    watch, broker = rig
    clock = Clock()
    clock.run(watch, broker, 5)
    broker.device = "full"
    for _ in range(30):  # the device keeps answering others' packets
        broker.replies += 1
        assert clock.run(watch, broker, 2) is None
    assert clock.run(watch, broker, 20) is not None  # no reply to anyone: hung


def test_a_restarted_device_starts_afresh(rig: tuple[DeviceWatch, ScriptedBroker]) -> None:
    watch, broker = rig
    clock = Clock()
    clock.run(watch, broker, 5)
    broker.device = "silent"
    assert clock.run(watch, broker, 20) is not None
    watch.device_started()
    assert not watch.tick(clock.now)
    broker.answer(wire.Header(op=wire.Op.INFO, tag=999))  # a reply of the killed device
    assert clock.run(watch, broker, 1) is None and not watch.rule.answered
    broker.epoch = 2
    broker.device = "answers"
    for h in broker.infos:
        broker.answer(h)  # the new device answers what waited in the mailboxes
    assert clock.run(watch, broker, 1) is None and watch.rule.answered and watch.epoch == 2
