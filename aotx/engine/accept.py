"""How a sampled token becomes output, on either engine: one rule, used by llama.cpp's
scheduler and by the vLLM runner alike, so that a request ends the same way whoever
samples it.

In order, a token:

1. that is negative ends the request FAILED (``Failure.GRAMMAR``): the grammar's matcher
   failed, so the engine had no token to give;
2. is counted (``sampled``, the engine's figures, time to first token or between tokens);
3. that ends generation (EOS, EOT…) ends it COMPLETED, ``stop``; it is not output;
4. is output: its bytes go through the request's :class:`OutputBuffer` (held back while
   they could start a stop string), its logprobs line is published, and it joins
   ``generated`` (the tokens the output is made of);
5. ends it ``stop`` when it completed a stop string, or when the request's grammar admits
   nothing more (a finished grammar is a complete output, even at the last token);
6. ends it ``length`` at ``max_tokens``, or when the sequence would hold its whole
   context once the token is fed (``held``: the positions it would then hold);
7. ends it CANCELLED when a cancel was asked;
8. else the request runs on.

The engine removes an ended request from its own lists and settles it
(:func:`aotx.engine.request.settle`).
"""

from __future__ import annotations

from ..wire import Finish, Phase
from .interface import EngineStats
from .request import Failure, Request

#: How a token ended its request: the phase, the finish reason and the failure.
Ending = tuple[Phase, Finish, Failure]
FAILED_GRAMMAR: Ending = (Phase.FAILED, Finish.NONE, Failure.GRAMMAR)
STOPPED: Ending = (Phase.COMPLETED, Finish.STOP, Failure.NONE)
LENGTH: Ending = (Phase.COMPLETED, Finish.LENGTH, Failure.NONE)
CANCELLED: Ending = (Phase.CANCELLED, Finish.NONE, Failure.NONE)


def accept(req: Request, token: int, piece: bytes, now: int, stats: EngineStats, *,
           eog: bool, held: int, context: int) -> Ending | None:
    """Accept ``token`` (its bytes ``piece``; ``eog``: it ends generation) for ``req`` at
    ``now`` (monotonic ns): None while the request runs on, else how it ended."""
    if token < 0:
        return FAILED_GRAMMAR
    req.sampled += 1
    stats.tokens_out += 1
    if not req.first_token_ns:
        req.first_token_ns = now
        stats.ttft.observe((now - req.created_ns) / 1e9)
    else:
        stats.itl.observe((now - req.last_token_ns) / 1e9)
    req.last_token_ns = now
    if eog:
        return STOPPED
    req.generated.append(token)
    assert req.buffer is not None
    if req.think != THINK_NONE:
        count_thinking(req, piece)
    published, stopped = req.buffer.push(piece)
    req.out += published
    if req.notes is not None:
        req.notes.push(len(piece), len(req.out))
    if stopped:
        req.stop_hit = req.buffer.matched + 1
    if stopped or (req.matcher is not None and req.matcher.finished):
        return STOPPED
    if req.sampled >= req.max_tokens or held >= context:
        return LENGTH
    if req.cancel_requested:
        return CANCELLED
    req.phase = Phase.RUNNING
    return None


#: Where a thinking model's output is (``Request.think``): not known yet (it may open
#: with its think block's opening, ``Request.think_tags``), inside the block, past it or
#: without one.
THINK_UNDECIDED, THINK_INSIDE, THINK_NONE = 0, 1, 2


def count_thinking(req: Request, piece: bytes) -> None:
    """Count ``piece``'s token among the request's reasoning tokens while it is in its
    think block (the tags' tokens included): the usage's ``reasoning_tokens``."""
    opening, *closings = req.think_tags
    if req.think == THINK_UNDECIDED:
        req.think_tail += piece
        head = req.think_tail.lstrip()
        req.reasoning_tokens += 1  # (tentative while the opening may still come)
        if len(head) < len(opening) and opening.startswith(head):
            return
        if not head.startswith(opening):
            req.think, req.reasoning_tokens, req.think_tail = THINK_NONE, 0, b""
            return
        req.think, req.think_tail = THINK_INSIDE, head[len(opening):]
    else:
        req.reasoning_tokens += 1
        keep = max(len(c) for c in closings) + len(piece)
        req.think_tail = (req.think_tail + piece)[-keep:]
    if any(c in req.think_tail for c in closings):
        req.think, req.think_tail = THINK_NONE, b""
