"""Dry runs on the device (protocol.md 5.5): a submission's prompt, not run.

The token routes ask the device what a body's prompt is: its token count, its token
ids and their bytes, or the chat template's rendering.  The device answers a page at
a time (one packet); :func:`pages` asks until it has them all.  A dry run for a model
that is not loaded waits for the load as a request would, and is asked again then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .. import wire
from . import calls
from .errors import ApiError, Call
from .service import Gateway, Principal

#: Asks of a dry run whose model was loaded for it, then unloaded before it was asked
#: again (the budget made room for another), before the route gives up with 503.
LOAD_TRIES = 3
#: How many items of a dry run's answer a page holds, by what the run asks.
UNITS: dict[int, Callable[[bytes], int]] = {
    wire.SUBMIT_DRY_TOKENS: lambda data: len(data) // 4,
    wire.SUBMIT_DRY_PIECES: lambda data: len(wire.decode_pieces(data)),
    wire.SUBMIT_DRY_TEXT: len,
}


def dry(h: wire.Header, ask: int = 0) -> wire.Header:
    """``h`` (a SUBMIT) as a dry run that lists ``ask`` (a SUBMIT_DRY_* bit, or 0)."""
    return h._replace(flags=h.flags | wire.SUBMIT_FLAG_DRY | ask, limit=0)


async def once(g: Gateway, principal: Principal, h: wire.Header, payload: bytes, call: Call
               ) -> tuple[wire.Header, bytes]:
    """One dry run's 200: one whose model is not loaded waits for the load, then asks
    again.  Its media (parts) take the media worker's deadline."""
    for _ in range(LOAD_TRIES):
        rh, data = await g.ask(h, payload, ok=(200, 202), context=call,
                               timeout=g.deadlines.of(h, media=bool(call.media)))
        if rh.status == 200:
            return rh, data
        await _loaded(g, principal, rh)
    raise ApiError(503, f"model {call.model!r} was unloaded again before it could be asked; "
                        "try again", headers={"Retry-After": "1"})


async def _loaded(g: Gateway, principal: Principal, rh: wire.Header) -> None:
    """Wait for the deferred dry run ``rh`` to end (its model loaded); a failed load's
    error is raised.  A caller that leaves takes the dry run with it."""
    last = rh
    try:
        async for last, _, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            pass
    except (asyncio.CancelledError, ApiError):
        await calls.cancel_quietly(g, principal, rh)
        raise
    if last.phase == wire.Phase.FAILED:
        raise await g.failure(last)


async def pages(g: Gateway, principal: Principal, h: wire.Header, payload: bytes, call: Call,
                ask: int) -> tuple[wire.Header, list[bytes]]:
    """A dry run that lists ``ask``: the first reply, and every page of the answer."""
    h = dry(h, ask)
    unit = UNITS[ask]  # (a KeyError for any other ask: a caller's bug)
    rh, data = await once(g, principal, h, payload, call)
    got, out = unit(data), [data]
    while got < rh.total:
        _, data = await once(g, principal, h._replace(limit=got), payload, call)
        if not unit(data):
            raise ApiError(502, "the device's dry run answered no more of its prompt")
        got += unit(data)
        out.append(data)
    return rh, out
