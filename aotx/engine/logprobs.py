"""Log-probabilities of the sampled tokens (OpenAI's ``logprobs``), and the per-request
stream of annotations that carries them.

**What is reported.**  For every token a request asked logprobs for, the log-softmax of
the logits row the sampler read, over the whole vocabulary: the model's own
distribution at temperature 1, after the grammar's mask (``grammar.apply_mask`` sets the
forbidden tokens to -inf in that very row before sampling) and before the sampler
chain's own changes (logit bias, penalties, top-k, top-p, min-p, temperature), which
llama.cpp applies to a copy.  So the chosen token's logprob is what the model gave it;
at temperature 0 with no bias or penalty it is the largest.  The ``k`` alternatives are
the k likeliest tokens of that distribution, likeliest first; tokens the grammar
forbids (logprob -inf) are never listed.

**Cost.**  The rows of one step are computed together (:func:`compute`): one max, one
exp-sum and one ``argpartition`` over an (n, vocabulary) matrix.  Requests without
logprobs take no part; ``bench/logprobs_cost.py`` measures the cost per token.

**The annotation stream** (:class:`Annotations`): one line of compact UTF-8 JSON per
token, appended when the token's bytes are published (all of them: the output buffer
may hold bytes back for a stop string or an incomplete UTF-8 sequence), so the stream
describes exactly the output bytes published so far::

    {"offset":12,"token":9906,"logprob":-0.0123,"bytes":[72,105],
     "top":[[9906,-0.0123,[72,105]],[15496,-4.51,[72,101,108,108,111]]]}

``offset`` is where the token's bytes start in the output, ``bytes`` are those bytes
(what the token adds to the output: a special token adds none), ``top`` the
alternatives as ``[token, logprob, bytes]``.  The end-of-generation token is never
published, so it has no line; nor has a token whose bytes a stop string cut (its first
bytes may be in the output, the rest were part of the stop string), nor one whose
incomplete UTF-8 tail was dropped at the end.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

#: The most alternatives a token may list (OpenAI's ``top_logprobs`` limit).
MAX_TOP = 20
Matrix = np.ndarray[Any, np.dtype[np.float32]]
Entry = tuple[float, list[tuple[int, float]]]  # (chosen's logprob, [(token, logprob)])


def compute(logits: Matrix, tokens: Sequence[int], ks: Sequence[int]) -> list[Entry]:
    """Row i's log-softmax at ``tokens[i]``, and its ``ks[i]`` likeliest tokens (finite
    logprobs only, likeliest first, ties by token id).  ``logits`` is (n, vocabulary)."""
    peak = logits.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
    kmax = min(max(ks, default=0), logits.shape[1])
    top = (np.argpartition(logits, -kmax, axis=1)[:, -kmax:] if kmax
           else np.empty((len(tokens), 0), dtype=np.intp))
    out: list[Entry] = []
    for i, (tok, k) in enumerate(zip(tokens, ks, strict=True)):
        ids = top[i]
        vals = logits[i, ids] - lse[i]
        order = np.lexsort((ids, -vals))[:k]
        alts = [(int(ids[j]), vals[j]) for j in order if np.isfinite(vals[j])]
        out.append((logits[i, tok] - lse[i], alts))
    return out


def line(token: int, entry: Entry, piece: Callable[[int], bytes], chosen: bytes) -> bytes:
    """A token's annotation without its offset: ``,"token":...}`` and the newline (the
    offset is known once the token's bytes are pushed: :meth:`Annotations.push`)."""
    lp, alts = entry
    body = orjson.dumps({"token": token, "logprob": lp, "bytes": list(chosen),
                         "top": [[t, v, list(piece(t))] for t, v in alts]},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    return b"," + body[1:] + b"\n"


class Annotations:
    """A request's annotation stream (module docstring): ``data`` holds the published
    lines; a token's line waits in ``pending`` until its last byte is published."""

    def __init__(self, top: int) -> None:
        self.top = top  # alternatives asked, 0..MAX_TOP
        self.data = bytearray()
        self.pushed = 0  # bytes pushed into the request's output buffer so far
        self.next: bytes | None = None  # the line of the token being accepted
        self.pending: collections.deque[tuple[int, bytes]] = collections.deque()

    def push(self, size: int, published: int) -> None:
        """The accepted token added ``size`` bytes to the output buffer, and the output
        now holds ``published`` bytes."""
        start, self.pushed = self.pushed, self.pushed + size
        if self.next is not None:
            self.pending.append((self.pushed, b'{"offset":%d' % start + self.next))
            self.next = None
        self.publish(published)

    def publish(self, published: int) -> None:
        while self.pending and self.pending[0][0] <= published:
            self.data += self.pending.popleft()[1]

    def end(self, published: int) -> None:
        """The request ended with ``published`` output bytes: what they hold is
        published; tokens not wholly in them never will be."""
        self.publish(published)
        self.pending.clear()
        self.next = None


def window(data: bytes | bytearray, cursor: int, limit: int) -> bytes | None:
    """The whole lines of ``data`` from ``cursor``, about ``limit`` bytes (at least one
    line if one is there); None when ``cursor`` does not start a line."""
    if cursor > len(data) or (cursor and data[cursor - 1] != 0x0A):
        return None
    chunk = bytes(data[cursor:cursor + limit])
    cut = chunk.rfind(b"\n") + 1
    if not cut and chunk:  # one line longer than the window: all of it
        return bytes(data[cursor:data.index(b"\n", cursor) + 1])
    return chunk[:cut]


def annotate(engine: Any, samples: Sequence[tuple[Any, int]],
             sampled: Sequence[tuple[Any, int]]) -> None:
    """Give each request that asked logprobs the line of its sampled token: ``samples``
    holds one step's (request, batch entry), ``sampled`` its (request, token); the rows
    are computed together from the entries' logits (as the sampler left them).  Failed
    samples (-1) and end-of-generation tokens get none."""
    todo = [(r.notes, idx, tok) for (r, idx), (_, tok) in zip(samples, sampled, strict=True)
            if r.notes is not None and tok >= 0 and not engine.is_eog(tok)]
    if not todo:
        return
    rows = engine.logits_rows([idx for _, idx, _ in todo])
    entries = compute(rows, [tok for _, _, tok in todo], [a.top for a, _, _ in todo])
    for (a, _, tok), entry in zip(todo, entries, strict=True):
        a.next = line(tok, entry, engine.piece, engine.piece(tok))
