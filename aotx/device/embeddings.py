"""EMBED: a packet of embedding inputs checked and tokenized on the control thread, then
embedded by the model's engine thread between its decode steps (engine/embedding.py).

The handler refuses at once (grant, model, payload, an input's tokens, the rate, the
principal's share of the calls in progress) or hands back an :class:`EmbedCall`: the
runtime keeps the mailbox busy and queues the call's job, and the engine thread answers
it (:func:`reply`) when its last input is embedded.

A call is withdrawn, and its mailbox answered at once (503 ``WITHDRAWN``), when its
``wait_ms`` runs out before that (its caller has given up) or when its caller sends
UNPARK with the call's identity (the client left): so the device never holds a call
nobody waits for, and the mailboxes a principal holds are those its caller counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .. import wire
from ..engine.embedding import Embeddings, EmbedJob
from ..engine.interface import Model
from ..mailbox import mailbox_share
from ..wire import Header, Reason
from .admission import Admission
from .errors import DeviceError
from .state import DeviceState


@dataclass(eq=False)
class EmbedCall:
    """An EMBED whose vectors the engine thread computes (its mailbox stays busy)."""

    mailbox: int
    header: Header
    queue: Embeddings
    inputs: list[list[int]]  # tokens, in order
    deadline: float = math.inf  # (monotonic) withdrawn then, unless answered
    job: EmbedJob | None = None  # once queued


#: The calls the device holds: (principal, the call's identity) -> the call.
EmbedCalls = dict[tuple[int, bytes], EmbedCall]


def embed(state: DeviceState, admission: Admission, calls: EmbedCalls, mailboxes: int,
          mailbox: int, h: Header, payload: bytes) -> EmbedCall:
    """Check an EMBED and tokenize its inputs (control thread, lock held); the order of the
    checks is docs/protocol.md's (section 5.3)."""
    grant = state.submit_grant(h, embed=True)
    model = state.models[h.role]
    assert model.embeddings is not None  # submit_grant checked it
    if grant.max_input_bytes and len(payload) > grant.max_input_bytes:
        raise DeviceError(413, Reason.INPUT_BYTES, grant.max_input_bytes)
    # A principal's calls in progress hold at most its share of the mailboxes, as the
    # gateway holds them (its share of the queue, whatever a caller sends).
    share = mailbox_share(mailboxes)
    if sum(1 for p, _ in calls if p == h.principal) >= share or (h.principal,
                                                                 h.identity) in calls:
        raise DeviceError(429, Reason.ACTIVE_LIMIT, share, retry_after=1)
    inputs = _inputs(model.engine, model.embeddings.embedder.context, h.cursor,
                     wire.decode_embed(payload), model.spec.kind == "rerank")
    if h.cursor == 0:  # the first packet of a call: one admission against the rate
        admission.check_rate(h, grant)
        state.counters.admitted += 1  # (aotx_requests_admitted_total counts calls)
    deadline = time.monotonic() + h.wait_ms / 1000 if h.wait_ms else math.inf
    return EmbedCall(mailbox, h, model.embeddings, inputs, deadline)


def _inputs(engine: Model, limit: int, cursor: int, items: list[str | tuple[int, ...]],
            rank: bool) -> list[list[int]]:
    """The tokens of each input, checked (``cursor``: the first one's index in the call).
    A reranker's packet is a query (a text) then documents (texts): an input is the query
    and a document joined (``rank_prompt``), indexed by the document."""
    texts = [x for x in items if isinstance(x, str)]
    if rank and (len(items) < 2 or len(texts) < len(items)):
        raise DeviceError(400, Reason.MALFORMED, fields={"cursor": cursor})
    inputs = []
    for i, x in enumerate(items[1:] if rank else items):
        # A text is a message's text: special-token texts in it stay text.
        if rank:
            tokens = engine.rank_prompt(texts[0], texts[i + 1])
        else:
            tokens = (engine.tokenize_pieces([(x, False)]) if isinstance(x, str) else list(x))
        where = {"cursor": cursor + i}
        bad = next((t for t in tokens if t >= engine.n_vocab), None)
        if bad is not None:
            raise DeviceError(400, Reason.TOKEN_ID, bad, fields=where)
        if len(tokens) > limit:
            raise DeviceError(400, Reason.PROMPT_LENGTH, limit,
                              fields={**where, "prompt_tokens": len(tokens)})
        inputs.append(tokens)
    return inputs


def withdraw_due(calls: EmbedCalls, now: float) -> float:
    """Withdraw every call whose deadline passed (lock held); the next deadline."""
    due = [c for c in calls.values() if c.deadline <= now]
    for c in due:
        if c.job is not None:
            c.queue.withdraw(c.job)  # answers it: the runtime drops it from ``calls``
    return min((c.deadline for c in calls.values()), default=math.inf)


def reply(state: DeviceState, call: EmbedCall, job: EmbedJob) -> tuple[Header, bytes]:
    """The answer to a finished call (engine thread, lock held): the vectors (a reranker's:
    the scores) as little-endian f32, or 500 DECODE when a decode failed."""
    if job.withdrawn:
        raise DeviceError(503, Reason.WITHDRAWN)
    if job.error:
        raise DeviceError(500, Reason.DECODE)
    return (call.header.reply(200, epoch=state.epoch, prompt_tokens=job.tokens),
            job.vectors.astype("<f4").tobytes())
