"""A dry run's reply (``SUBMIT_FLAG_DRY``): the prompt a submission would run, not run.

Admission checks, renders and tokenizes a dry run as it would a request (the grant, its
model mask, the template, media and automatic memory alike), then answers 200 here
instead of queueing it.  ``prompt_tokens`` is what the request's usage would report.
The flags ask for more, from the header's ``first_item`` on, as much as one reply holds
(the caller asks again from where it stopped): the token ids, the ids with their bytes,
or the template's rendering.  The token routes (/tokenize, /detokenize,
/apply-template, the input-token counts) are dry runs.
"""

from __future__ import annotations

import struct

from .. import wire
from ..engine.interface import Model
from ..wire import Header

#: Token ids in one reply.
TOKENS_PER_REPLY = wire.MAX_PAYLOAD // 4


def reply(h: Header, engine: Model, rendering: str, prompt: list[int], epoch: int
          ) -> tuple[Header, bytes]:
    """The 200 of dry run ``h`` whose prompt is ``prompt`` (the template's ``rendering``):
    ``total`` is the count of what the flags list (tokens, or the rendering's bytes),
    the payload the part from ``first_item``."""
    total = (len(rendering.encode("utf-8")) if h.submit_flags & wire.SUBMIT_DRY_TEXT
             else len(prompt))
    data = answer(h, engine, rendering, prompt, h.first_item, wire.MAX_PAYLOAD)
    return h.reply(200, epoch=epoch, prompt_tokens=len(prompt), total=total), data


def answer(h: Header, engine: Model, rendering: str, prompt: list[int], first: int = 0,
           room: int | None = None) -> bytes:
    """What dry run ``h`` lists, from token (or byte) ``first`` on, within ``room`` bytes
    (None: all of it; a deferred dry run's output holds it whole)."""
    flags = h.submit_flags
    count = len(prompt) if room is None else TOKENS_PER_REPLY
    if flags & wire.SUBMIT_DRY_TEXT:
        text = rendering.encode("utf-8")
        return text[first:] if room is None else text[first:first + room]
    if flags & wire.SUBMIT_DRY_PIECES:
        # (a media part's positions have no bytes: they are listed with none)
        data, _ = wire.encode_pieces(
            [(t, engine.token_bytes(t) if t >= 0 else b"") for t in prompt[first:first + count]],
            room if room is not None else 1 << 62)
        return data
    if flags & wire.SUBMIT_DRY_TOKENS:
        part = prompt[first:first + count]
        return struct.pack(f"<{len(part)}i", *part)
    return b""
