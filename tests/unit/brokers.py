"""The broker client's contract for scripted brokers in gateway unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aotx import wire


class AnsweringBroker:
    """``call`` as BrokerClient's: the subclass's :meth:`answer`, and ``settled`` once it
    is given (the device no longer holds the packet).  A caller that is cancelled leaves
    the answer running, as the device keeps a packet it was sent until it answers it."""

    async def call(self, h: wire.Header, payload: bytes = b"", timeout: float = 120.0,
                   settled: Callable[[], None] | None = None) -> tuple[wire.Header, bytes]:
        answer = asyncio.ensure_future(self.answer(h, payload, timeout))
        if settled is not None:
            answer.add_done_callback(lambda _: settled())
        answer.add_done_callback(lambda t: t.cancelled() or t.exception())  # (retrieved)
        return await asyncio.shield(answer)

    async def answer(self, h: wire.Header, payload: bytes, timeout: float
                     ) -> tuple[wire.Header, bytes]:
        raise NotImplementedError
