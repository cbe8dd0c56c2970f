"""The broker client's contract for scripted brokers in gateway unit tests."""

from __future__ import annotations

from collections.abc import Callable

from aotx import wire


class AnsweringBroker:
    """``call`` as BrokerClient's: the subclass's :meth:`answer`, and ``settled`` once it
    is given (the device no longer holds the packet)."""

    async def call(self, h: wire.Header, payload: bytes = b"", timeout: float = 120.0,
                   settled: Callable[[], None] | None = None) -> tuple[wire.Header, bytes]:
        try:
            return await self.answer(h, payload, timeout)
        finally:
            if settled is not None:
                settled()

    async def answer(self, h: wire.Header, payload: bytes, timeout: float
                     ) -> tuple[wire.Header, bytes]:
        raise NotImplementedError
