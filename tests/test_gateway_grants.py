"""The gateway's grant installation when the broker fails it (the broker layer faked;
tests/test_e2e_grants.py runs the real service)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from starlette.requests import Request

from aotx import wire
from aotx.brokerclient import BrokerUnavailable
from aotx.errors import ApiError
from aotx.gateway import Gateway
from aotx.paths import RuntimePaths

from .conftest import short_tmpdir

INFO = wire.Info(epoch=7, models=(wire.ModelInfo(1, "smollm2", bytes(32), wire.MOD_TEXT, 0, 2048),),
                 window_bytes=32768, context_tokens=2048, output_tokens=2048, active_requests=0,
                 slots=4, media_bytes=0, retention_seconds=60, retention_requests=10,
                 mailboxes=8, kv_cells=8192, started_unix_ns=0)


class FlakyBroker:
    """Answers INFO and GRANT_READ; GRANT_INSTALL fails while ``failing`` (as when the
    broker has no free mailbox or is restarting) and otherwise records the rows."""

    def __init__(self) -> None:
        self.failing = False
        self.read_status = 200
        self.device: dict[int, wire.Grant] = {}
        self.installs = 0

    async def call(self, h: wire.Header, payload: bytes = b"",
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
    whole installation fail."""
    from aotx.credentials import CredentialError, parse_limits

    assert parse_limits(["input_bytes=4294967295", "media_bytes=5000000000"]) == {
        "input_bytes": 4294967295, "media_bytes": 5000000000}
    for bad in ("input_bytes=4294967296", "rate=99999999999", "media_bytes=" + str(1 << 64)):
        with pytest.raises(CredentialError, match="below 2"):
            parse_limits([bad])
