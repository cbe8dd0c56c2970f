"""Dry runs on the device (protocol.md 5.5): a submission's prompt, not run.

The token routes ask the device what a body's prompt is: its token count, its token
ids and their bytes, or the chat template's rendering.  The device answers a page at
a time (one packet); :func:`pages` asks until it has them all.  A dry run for a model
that is not loaded waits for the load as a request would: its output is then the whole
answer, read as a request's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .. import wire
from . import calls
from .errors import ApiError, Call
from .service import Gateway, Principal

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
               ) -> tuple[wire.Header, bytes, bool]:
    """One dry run: its 200 and page, or, for one that waited for its model's load, its
    final state and its whole answer (True).  Its media take the media worker's deadline."""
    rh, data = await g.ask(h, payload, ok=(200, 202), context=call,
                           timeout=g.deadlines.of(h, media=bool(call.media)))
    if rh.status == 200:
        return rh, data, False
    last, whole = await _ended(g, principal, rh)
    return last, whole, True


async def _ended(g: Gateway, principal: Principal, rh: wire.Header) -> tuple[wire.Header, bytes]:
    """The deferred dry run ``rh`` followed to its end: its state and output (the whole
    answer); a failed load's error is raised.  A caller that leaves takes it along."""
    last, out = rh, bytearray()
    try:
        async for last, data, _ in calls.follow(g, principal, rh.epoch, rh.identity, 0):  # noqa: B007
            out += data
    except (asyncio.CancelledError, ApiError):
        await calls.cancel_quietly(g, principal, rh)
        raise
    if last.phase == wire.Phase.FAILED:
        raise await g.failure(last)
    if last.phase != wire.Phase.COMPLETED:
        raise ApiError(409, "the dry run was cancelled")
    return last, bytes(out)


async def pages(g: Gateway, principal: Principal, h: wire.Header, payload: bytes, call: Call,
                ask: int) -> tuple[wire.Header, list[bytes]]:
    """A dry run that lists ``ask``: the first reply, and every page of the answer.  The
    pages must be of one prompt: one whose ``total`` changed (automatic memory learnt a
    fact meanwhile) is a 409 to try again."""
    h = dry(h, ask)
    unit = UNITS[ask]  # (a KeyError for any other ask: a caller's bug)
    rh, data, whole = await once(g, principal, h, payload, call)
    got, out = unit(data), [data]
    while not whole and got < rh.total:
        nh, data, whole = await once(g, principal, h._replace(limit=got), payload, call)
        if whole:  # (its model was unloaded meanwhile, and loaded again: all of it)
            return nh, [data]
        if nh.total != rh.total:
            raise ApiError(409, "the prompt changed while it was read; try again")
        if not unit(data):
            raise ApiError(502, "the device's dry run answered no more of its prompt")
        got += unit(data)
        out.append(data)
    return rh, out
