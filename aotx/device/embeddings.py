"""EMBED: a packet of embedding inputs checked and tokenized on the control thread, then
embedded by the model's engine thread between its decode steps (engine/embedding.py).

The handler refuses at once (grant, model, payload, an input's tokens, the rate) or hands
back an :class:`EmbedCall`: the runtime keeps the mailbox busy and queues the call's job,
and the engine thread answers it (:func:`reply`) when its last input is embedded.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire
from ..engine.embedding import Embeddings, EmbedJob
from ..wire import Header, Reason
from .admission import Admission
from .errors import DeviceError
from .state import DeviceState


@dataclass
class EmbedCall:
    """An EMBED whose vectors the engine thread computes (its mailbox stays busy)."""

    mailbox: int
    header: Header
    queue: Embeddings
    inputs: list[list[int]]  # tokens, in order


def embed(state: DeviceState, admission: Admission, mailbox: int, h: Header,
          payload: bytes) -> EmbedCall:
    """Check an EMBED and tokenize its inputs (control thread, lock held); the order of the
    checks is docs/protocol.md's (section 5.3)."""
    grant = state.submit_grant(h, embed=True)
    model = state.models[h.role]
    assert model.embeddings is not None  # submit_grant checked it
    if grant.max_input_bytes and len(payload) > grant.max_input_bytes:
        raise DeviceError(413, Reason.INPUT_BYTES, grant.max_input_bytes)
    engine, limit = model.engine, model.embeddings.embedder.context
    inputs = []
    for i, x in enumerate(wire.decode_embed(payload)):
        # A text is a message's text: special-token texts in it stay text.
        tokens = (engine.tokenize_pieces([(x, False)]) if isinstance(x, str) else list(x))
        where = {"cursor": h.cursor + i}
        bad = next((t for t in tokens if t >= engine.n_vocab), None)
        if bad is not None:
            raise DeviceError(400, Reason.TOKEN_ID, bad, fields=where)
        if len(tokens) > limit:
            raise DeviceError(400, Reason.PROMPT_LENGTH, limit,
                              fields={**where, "prompt_tokens": len(tokens)})
        inputs.append(tokens)
    if h.cursor == 0:  # the first packet of a call: one admission against the rate
        admission.check_rate(h, grant)
        state.counters.admitted += 1  # (aotx_requests_admitted_total counts calls)
    return EmbedCall(mailbox, h, model.embeddings, inputs)


def reply(state: DeviceState, call: EmbedCall, job: EmbedJob) -> tuple[Header, bytes]:
    """The answer to a finished call (engine thread, lock held): the vectors as
    little-endian f32, or 500 DECODE when a decode failed."""
    if job.error:
        raise DeviceError(500, Reason.DECODE)
    return (call.header.reply(200, epoch=state.epoch, prompt_tokens=job.tokens),
            job.vectors.astype("<f4").tobytes())
