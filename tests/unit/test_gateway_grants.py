"""The gateway's grant installation when the broker fails it (the broker layer faked;
tests/e2e/test_e2e_grants.py runs the real service)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from starlette.requests import Request

from aotx import wire
from aotx.gateway import calls
from aotx.gateway.broker_client import BrokerUnavailable
from aotx.gateway.errors import ApiError
from aotx.gateway.service import Gateway
from aotx.paths import RuntimePaths

from ..helpers import short_tmpdir
from .brokers import AnsweringBroker

INFO = wire.Info(epoch=7, models=(wire.ModelInfo(1, "smollm2", bytes(32), wire.MOD_TEXT, 0, 2048),),
                 window_bytes=32768, context_tokens=2048, output_tokens=2048, active_requests=0,
                 slots=4, media_bytes=0, retention_seconds=60, retention_requests=10,
                 mailboxes=8, kv_cells=8192, started_unix_ns=0)


class FlakyBroker(AnsweringBroker):
    """Answers INFO and GRANT_READ; GRANT_INSTALL fails while ``failing`` (as when the
    broker has no free mailbox or is restarting) and otherwise records the rows."""

    def __init__(self) -> None:
        self.failing = False
        self.read_status = 200
        self.device: dict[int, wire.Grant] = {}
        self.installs = 0

    async def answer(self, h: wire.Header, payload: bytes = b"",
                     timeout: float = 120.0) -> tuple[wire.Header, bytes]:
        if h.op is wire.Op.INFO:
            return h.reply(200, epoch=INFO.epoch), wire.encode_info(INFO)
        if h.op is wire.Op.GRANT_READ:
            rows = sorted((g for g in self.device.values() if g.principal >= h.cursor),
                          key=lambda g: g.principal)[:wire.GRANT_PAGE]
            return h.reply(self.read_status, epoch=INFO.epoch, total=len(rows)), \
                wire.encode_grants(rows) if self.read_status == 200 else b"busy"
        if h.op is wire.Op.GRANT_INSTALL:
            if self.failing:
                raise BrokerUnavailable("no free mailbox")
            self.installs += 1
            for g in wire.decode_grants(payload, h.total):
                self.device[g.principal] = g
            return h.reply(200, epoch=INFO.epoch, total=h.total), b""
        if h.op is wire.Op.MODELS:  # (as a device without models loaded on first use)
            return h.reply(501, epoch=INFO.epoch, reason=wire.Reason.NOT_SUPPORTED), b""
        raise AssertionError(h.op)


@pytest.fixture
def gateway():
    state = short_tmpdir()
    paths = RuntimePaths(state)
    paths.ensure()
    g = Gateway(paths)
    g.broker = FlakyBroker()  # type: ignore[assignment]
    try:
        yield g
    finally:
        g.store.close()
        shutil.rmtree(state, ignore_errors=True)


def request(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


def test_a_failed_install_at_a_new_epoch_leaves_the_epoch_new(gateway: Gateway) -> None:
    broker: FlakyBroker = gateway.broker  # type: ignore[assignment]
    broker.failing = True
    with pytest.raises(BrokerUnavailable):
        asyncio.run(gateway.refresh())
    assert gateway.info is None and not broker.device  # not ready: the next call tries again
    broker.failing = False
    asyncio.run(gateway.refresh())
    assert gateway.epoch == INFO.epoch and broker.device and not gateway.grants_dirty


def test_a_refused_grant_read_is_not_taken_for_an_empty_device(gateway: Gateway) -> None:
    """Reinstalling every row would bump every revision and hide earlier results."""
    broker: FlakyBroker = gateway.broker  # type: ignore[assignment]
    broker.read_status = 503
    with pytest.raises(BrokerUnavailable):
        asyncio.run(gateway.refresh())
    assert broker.installs == 0 and gateway.info is None


def test_a_grant_change_that_failed_to_install_is_installed_later(gateway: Gateway) -> None:
    broker: FlakyBroker = gateway.broker  # type: ignore[assignment]
    asyncio.run(gateway.refresh())
    _, token = gateway.store.create_token("alice", actions=int(wire.Action.READ))
    broker.failing = True
    with pytest.raises(ApiError) as err:  # not a 500, and not run under the old grants
        asyncio.run(gateway.authenticate(request(token)))
    assert err.value.status == 503
    assert gateway.grants_dirty
    alice = next(p.id for p in gateway.store.principals() if p.name == "alice")
    assert alice not in broker.device
    # No credential changes since: the next request (or the poll loop) installs it.
    broker.failing = False
    principal = asyncio.run(gateway.authenticate(request(token)))
    assert principal.id == alice and broker.device[alice].actions == int(wire.Action.READ)
    assert not gateway.grants_dirty


def test_more_rows_than_one_packet_are_read_a_page_at_a_time(gateway: Gateway) -> None:
    """A device holding more grant rows than one reply packet carries (1022) is read
    page by page, not taken for an empty device."""
    broker: FlakyBroker = gateway.broker  # type: ignore[assignment]
    for pid in range(1, 2501):
        broker.device[pid] = wire.Grant(principal=pid, actions=1, model_mask=2, revision=3)
    held = asyncio.run(gateway.read_grants())
    assert [g.principal for g in held] == list(range(1, 2501))


def test_limits_that_do_not_fit_the_device_row_are_refused() -> None:
    """Every grant row goes to the device; a limit wider than its field would make the
    whole installation fail, and one of 0 would read as no limit."""
    from aotx.gateway.credentials import CredentialError, parse_limits

    assert parse_limits(["input_bytes=4294967295", "media_bytes=5000000000"]) == {
        "input_bytes": 4294967295, "media_bytes": 5000000000}
    for bad in ("input_bytes=4294967296", "rate=99999999999", "media_bytes=" + str(1 << 64)):
        with pytest.raises(CredentialError, match="below 2"):
            parse_limits([bad])
    # 0 is the row's "not set": a limit of 0 would be none at all, so it is refused
    for key in ("active", "rate", "media_sources"):
        with pytest.raises(CredentialError, match="1 or more"):
            parse_limits([f"{key}=0"])
    # A row stored before the check still encodes (clamped: as good as unlimited).
    from aotx.gateway.credentials import PrincipalGrant

    row = PrincipalGrant(5, "old", 1, ("*",), {"input_bytes": 1 << 40, "rate": 10}).row({})
    assert row.max_input_bytes == (1 << 32) - 1 and row.rate_per_minute == 10
    wire.encode_grants([row])


class StreamingBroker(FlakyBroker):
    """A request that produces no output until ``produce``; WAITs park until then."""

    def __init__(self) -> None:
        super().__init__()
        self.out = b""
        self.changed = asyncio.Event()
        self.parked = self.most_parked = self.reads = 0
        self.parked_by: dict[int, int] = {}

    def state(self, h: wire.Header, data: bytes) -> tuple[wire.Header, bytes]:
        return h.reply(200, epoch=INFO.epoch, phase=int(wire.Phase.RUNNING),
                       total=len(self.out)), data

    async def answer(self, h: wire.Header, payload: bytes = b"",
                     timeout: float = 120.0) -> tuple[wire.Header, bytes]:
        if h.op is wire.Op.READ:
            self.reads += 1
            return self.state(h, self.out[h.cursor:])
        if h.op is wire.Op.WAIT:
            self.parked += 1
            self.parked_by[h.principal] = self.parked_by.get(h.principal, 0) + 1
            self.most_parked = max(self.most_parked, self.parked)
            try:
                await self.changed.wait()
            finally:
                self.parked -= 1
            return self.state(h, self.out[h.cursor:])
        return await super().answer(h, payload, timeout)


def test_one_principal_parks_at_most_its_share_of_the_mailboxes(gateway: Gateway) -> None:
    """INFO says 8 mailboxes: one principal's calls hold 2 at most (MAILBOX_SHARE), its
    streams park 1 WAIT, the rest poll with READs (holding no mailbox) and see the output
    as soon as it comes; another principal's stream still parks."""
    from aotx.gateway.service import Principal

    broker = StreamingBroker()
    gateway.broker = broker  # type: ignore[assignment]
    asyncio.run(gateway.refresh())
    grant = gateway.principals[1]
    alice, bob = Principal(1, "admin", grant), Principal(2, "bob", grant)
    seen = wire.Header(op=wire.Op.WAIT, phase=int(wire.Phase.RUNNING))

    async def main() -> list[bytes]:
        waits = [asyncio.create_task(calls.read(gateway, alice, INFO.epoch, bytes(16), 0,
                                                op=wire.Op.WAIT, seen=seen))
                 for _ in range(10)]
        await asyncio.sleep(0.3)
        assert broker.parked_by == {1: 1} and broker.reads > 0  # 1 parked, 9 polling
        other = asyncio.create_task(calls.read(gateway, bob, INFO.epoch, bytes(16), 0,
                                               op=wire.Op.WAIT, seen=seen))
        await asyncio.sleep(0.1)
        assert broker.parked_by == {1: 1, 2: 1}
        broker.out = b"hello"
        broker.changed.set()
        done = await asyncio.wait_for(asyncio.gather(*waits, other), 5)
        return [body for _, body in done]

    assert asyncio.run(main()) == [b"hello"] * 11
    assert broker.most_parked == 2 and not gateway.parked


def test_a_cancelled_wait_keeps_its_mailbox_counted_until_the_device_answers(
        gateway: Gateway) -> None:
    """A stream's client leaves while its WAIT is parked: the gateway sends UNPARK, and
    counts the WAIT as parked until its reply comes (the mailbox is held until then)."""
    from aotx.gateway.service import Principal

    broker = StreamingBroker()
    unparked: list[wire.Header] = []
    plain_call = broker.answer

    async def call(h: wire.Header, payload: bytes = b"",
                   timeout: float = 120.0) -> tuple[wire.Header, bytes]:
        if h.op is wire.Op.UNPARK:
            unparked.append(h)
            await asyncio.sleep(0.2)  # the device answers the WAIT a little later
            broker.changed.set()
            return h.reply(200, epoch=INFO.epoch), b""
        return await plain_call(h, payload, timeout)

    broker.answer = call  # type: ignore[method-assign]
    gateway.broker = broker  # type: ignore[assignment]
    asyncio.run(gateway.refresh())
    alice = Principal(1, "admin", gateway.principals[1])
    seen = wire.Header(op=wire.Op.WAIT, phase=int(wire.Phase.RUNNING))

    async def main() -> None:
        wait = asyncio.create_task(calls.read(gateway, alice, INFO.epoch, bytes([7]) * 16, 0,
                                              op=wire.Op.WAIT, seen=seen))
        await asyncio.sleep(0.05)
        wait.cancel()  # the client left
        await asyncio.sleep(0.05)
        assert wait.cancelled() and gateway.parked == {1: 1}  # still held on the device
        assert [(h.principal, h.identity) for h in unparked] == [(1, bytes([7]) * 16)]
        await asyncio.sleep(0.3)
        assert gateway.parked == {} and not gateway.background

    asyncio.run(main())


class RestartedBroker(FlakyBroker):
    """A device that restarted (epoch 8) before the gateway noticed: it refuses a call
    with 403 until the gateway has reinstalled the grants, then holds each call until
    ``go`` is set, counting each principal's calls it holds at once."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = INFO.epoch
        self.go = asyncio.Event()
        self.holding: dict[int, int] = {}
        self.most: dict[int, int] = {}
        self.refused = 0

    async def answer(self, h: wire.Header, payload: bytes = b"",
                     timeout: float = 120.0) -> tuple[wire.Header, bytes]:
        if h.op is wire.Op.INFO:
            return h.reply(200, epoch=self.epoch), wire.encode_info(INFO._replace(epoch=self.epoch))
        if h.op is not wire.Op.READ:
            reply, body = await super().answer(h, payload, timeout)
            return reply._replace(epoch=self.epoch), body
        if h.principal not in self.device:  # (the restarted device holds no grant yet)
            self.refused += 1
            return h.refuse(403, wire.Reason.NO_GRANT, 0, epoch=self.epoch), b""
        self.holding[h.principal] = n = self.holding.get(h.principal, 0) + 1
        self.most[h.principal] = max(self.most.get(h.principal, 0), n)
        await self.go.wait()
        self.holding[h.principal] -= 1
        return h.reply(200, epoch=self.epoch), b""


def test_a_call_retried_after_a_device_restart_stays_within_the_share(
        gateway: Gateway) -> None:
    """Six calls of one principal refused by a restarted device are each retried once
    the grants are back, and the retries hold at most the principal's share of the
    mailboxes (2 of 8) at once, as the first sends did."""
    broker = RestartedBroker()
    gateway.broker = broker  # type: ignore[assignment]
    asyncio.run(gateway.refresh())
    pid = next(iter(gateway.principals))

    async def main() -> list[int]:
        broker.epoch, broker.device = 8, {}  # the device restarted
        read = wire.Header(op=wire.Op.READ, principal=pid, identity=bytes(16))
        calls_ = [asyncio.create_task(gateway.call(read)) for _ in range(6)]
        await asyncio.sleep(0.2)
        assert gateway.epoch == 8 and broker.holding == {pid: 2}  # 4 wait in the gateway
        broker.go.set()
        return [h.status for h, _ in await asyncio.wait_for(asyncio.gather(*calls_), 5)]

    assert asyncio.run(main()) == [200] * 6
    assert broker.most == {pid: 2} and broker.refused == 6  # each refused once
