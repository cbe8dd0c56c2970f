"""EMBED calls on a device with a scripted model and a fake embedder: a call is withdrawn
when its caller's wait runs out or its caller sends UNPARK, its mailbox answered at
once; a principal's calls in progress hold at most its share of the mailboxes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from aotx import wire
from aotx.device.embeddings import withdraw_due
from aotx.device.runtime import Device
from aotx.engine.embedding import EmbedQueue

from .devices import call, scripted_device
from .test_embedding_queue import FakeEmbedder


@pytest.fixture
def device() -> Iterator[tuple[Device, EmbedQueue]]:
    with scripted_device() as (dev, _sched):
        q = EmbedQueue(FakeEmbedder(context=64), dev.state.lock, lambda: None)  # type: ignore[arg-type]
        dev.state.models[1].embeddings = q
        yield dev, q


def embed(dev: Device, mailbox: int, ident: int, wait_ms: int = 30_000,
          principal: int = 7) -> tuple[wire.Header, bytes] | None:
    h = wire.Header.request(wire.Op.EMBED, principal=principal, role=1,
                            identity=bytes([ident]) * 16, wait_ms=wait_ms)
    with dev.state.lock:
        return dev.respond(mailbox, h, wire.encode_embed(["hello", "world"]))


def answer(dev: Device, mailbox: int) -> wire.Header:
    """The reply the device published in ``mailbox``."""
    assert dev.region.state(mailbox) == 2
    return wire.decode_packet(dev.region.read(mailbox))[0]


def test_a_call_whose_wait_ran_out_is_withdrawn_and_its_mailbox_answered(
        device: tuple[Device, EmbedQueue]) -> None:
    dev, q = device
    assert embed(dev, 1, 1, wait_ms=50) is None and embed(dev, 2, 2) is None
    assert len(dev.handlers.embeds) == 2 and dev.busy_mailboxes == {1, 2}
    with dev.state.lock:
        nxt = withdraw_due(dev.handlers.embeds, time.monotonic())
    assert nxt < time.monotonic() + 0.06 and not dev.region.state(1) == 2  # not yet due
    with dev.state.lock:
        withdraw_due(dev.handlers.embeds, time.monotonic() + 0.06)
    h = answer(dev, 1)
    assert (h.status, h.reason, h.identity) == (503, wire.Reason.WITHDRAWN, bytes([1]) * 16)
    assert list(dev.handlers.embeds) == [(7, bytes([2]) * 16)] and dev.busy_mailboxes == {2}
    while q.pending():
        q.step()
    assert answer(dev, 2).status == 200 and not dev.handlers.embeds and not dev.busy_mailboxes
    assert q.withdrawn == 1 and q.inputs == 2  # the withdrawn call's inputs never ran


def test_unpark_withdraws_the_callers_own_call_only(device: tuple[Device, EmbedQueue]) -> None:
    dev, q = device
    dev.state.grants[8] = dev.state.grants[7]._replace(principal=8)
    assert embed(dev, 1, 1) is None
    other = wire.Header(op=wire.Op.UNPARK, principal=8, identity=bytes([1]) * 16)
    with dev.state.lock:
        refused = dev.respond(3, other, b"")
    assert refused is not None and refused[0].status == 404  # not principal 8's call
    assert dev.region.state(1) != 2 and len(dev.handlers.embeds) == 1
    h, _ = call(dev, wire.Header(op=wire.Op.UNPARK, identity=bytes([1]) * 16))
    assert h.status == 200
    assert answer(dev, 1).reason == wire.Reason.WITHDRAWN and not dev.handlers.embeds
    q.step()
    assert q.decodes == 0 or q.inputs == 0


def test_a_principals_calls_hold_at_most_its_share_of_the_mailboxes(
        device: tuple[Device, EmbedQueue]) -> None:
    """Four mailboxes: a principal's share is 2 (as the gateway counts), whatever it sends;
    another principal's call is still taken, and a finished call makes room."""
    dev, q = device
    dev.state.grants[8] = dev.state.grants[7]._replace(principal=8)
    assert embed(dev, 0, 1) is None and embed(dev, 1, 2) is None
    refused = embed(dev, 2, 3)
    assert refused is not None
    assert (refused[0].status, refused[0].reason) == (429, wire.Reason.ACTIVE_LIMIT)
    assert refused[0].detail == 2
    again = embed(dev, 2, 2)  # the identity of a call in progress: refused too
    assert again is not None and again[0].status == 429
    assert embed(dev, 3, 9, principal=8) is None
    while q.pending():
        q.step()
    assert embed(dev, 0, 4) is None  # answered calls hold nothing


def test_the_engine_thread_and_a_withdrawal_answer_a_call_once(
        device: tuple[Device, EmbedQueue]) -> None:
    """A withdrawal while the engine thread decodes the call's inputs: one answer."""
    dev, q = device
    assert embed(dev, 1, 1) is None
    published: list[int] = []
    real = dev._publish

    def counting(mailbox: int, header: wire.Header, payload: bytes) -> None:
        published.append(mailbox)
        real(mailbox, header, payload)

    dev._publish = counting  # type: ignore[method-assign]
    fake = q.embedder
    plain = fake.embed
    withdrawing = threading.Event()

    def slow(inputs: list[list[int]]):  # type: ignore[no-untyped-def]
        with dev.state.lock:
            dev.handlers.unpark(wire.Header(op=wire.Op.UNPARK, principal=7,
                                            identity=bytes([1]) * 16))
        withdrawing.set()
        return plain(inputs)

    fake.embed = slow  # type: ignore[method-assign]
    q.step()
    assert withdrawing.is_set() and published == [1]
    assert answer(dev, 1).reason == wire.Reason.WITHDRAWN
