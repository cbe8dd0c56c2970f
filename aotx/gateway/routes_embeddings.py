"""``POST /v1/embeddings`` (OpenAI's embeddings route) on the device's EMBED operation.

The inputs go to the device in EMBED packets: as many inputs as one packet takes and its
reply can hold (each vector is ``embedding_dims`` float32), and about one embedding
decode's worth of tokens, so that a packet's answer comes within its deadline whatever
else the engine does.  The packets of one call are sent one after the other; the device
packs inputs of every queued packet (this call's and others') into each decode.  The
first packet (``cursor`` 0) is the call's admission against the grant's rate.

The vectors come back as little-endian float32, unit length: ``encoding_format: "base64"``
sends those bytes as they are (OpenAI's format), ``"float"`` writes each value as the
double it is (``float(np.float32)``), so both decode to the same numbers.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from .. import wire
from . import schemas as S
from .body import Body
from .errors import ApiError, Call, refusal
from .service import Caller, Gateway, Principal, Service, until_disconnected

router = APIRouter(tags=["standard"], redirect_slashes=False)

Token = Annotated[int, Field(ge=0, lt=1 << 32)]
#: Decodes' worth of tokens one packet may ask for (text: its bytes bound its tokens):
#: 512 of SmolLM2's, 2.5 s alone on two cores, about 9 s while the embedder is shared
#: and streams run beside (two packets of 1,024 took up to 28 s: withdrawn).
PACKET_DECODES = 1
#: Seconds before the gateway's deadline at which the device withdraws a packet: its
#: 503 then comes back in time, and its mailbox is free when the caller gives up.
WITHDRAW_MARGIN = 2.0
#: How long a call waits for its model's load (a model loaded on first use: the device
#: answers MODEL_UNLOADED and starts the load), as a chat request waits on the device.
LOAD_WAIT = 120.0


class EmbeddingRequest(Body):
    """The body of ``POST /v1/embeddings``; a field not listed here is refused (400)."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | list[Token] | list[list[Token]] = Field(
        description="a string, an array of strings, an array of token ids, or an array of "
                    "token-id arrays: at most 2048 inputs, none empty")
    encoding_format: Literal["float", "base64"] | None = None  # None: "float"
    dimensions: int | None = Field(default=None, description="refused (400): the vectors "
                                                             "have the model's own dimensions")
    user: str | None = Field(default=None, max_length=256,
                             description="accepted; the caller is the token's principal")

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: strings, or token arrays."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and isinstance(x[0], int):
            return [x]
        return x  # type: ignore[return-value]


@router.post("/v1/embeddings", response_model=S.EmbeddingList)
async def embeddings(body: EmbeddingRequest, request: Request, principal: Principal = Caller,
                     g: Gateway = Service) -> Response:
    await g.ensure_ready()
    m = g.model_for(body.model, principal)
    if not m.embedding_dims or m.rerank:
        raise ApiError(400, f"model {m.alias!r} does not provide embeddings"
                            + (" (a reranker: /v1/rerank)" if m.rerank else ""), param="model")
    if body.dimensions is not None:
        raise ApiError(400, f"model {m.alias!r} does not support dimensions: its vectors "
                            f"have {m.embedding_dims}", param="dimensions")
    inputs = _checked(body.inputs(), m)
    vectors, tokens = await until_disconnected(request, embed_all(g, principal, m, inputs))
    row = 4 * m.embedding_dims
    if body.encoding_format == "base64":
        items: list[Any] = [base64.b64encode(vectors[i:i + row]).decode("ascii")
                            for i in range(0, len(vectors), row)]
    else:
        items = list(np.frombuffer(bytes(vectors), "<f4").astype(np.float64)
                     .reshape(-1, m.embedding_dims))
    return Response(orjson.dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e}
                 for i, e in enumerate(items)],
        "model": m.alias,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


async def embed_all(g: Gateway, principal: Principal, m: wire.ModelInfo,
                     inputs: list[str] | list[list[int]], query: str | None = None
                     ) -> tuple[bytearray, int]:
    """Every input's vector, packet after packet; and their tokens.  A reranker's
    (``query``): every document's score, the query first in each packet.

    One call of a principal's at a time goes to the device; its others wait here for
    their turn, up to a packet's deadline (then 429).  The device embeds a principal's
    inputs in order anyway, so this costs it nothing; and a principal whose calls
    outnumber what the device does within a deadline has them wait here, not half done
    on the device and then withdrawn, which would leave it nothing done at all."""
    turn = g.embed_turns.setdefault(principal.id, asyncio.Semaphore(1))
    try:
        async with asyncio.timeout(g.deadlines.of(wire.Header(op=wire.Op.EMBED))):
            await turn.acquire()
    except TimeoutError:
        raise ApiError(429, "your earlier embedding calls are still being computed; send "
                            "this one again when one of them has answered",
                       code="embedding_calls_in_progress", headers={"Retry-After": "1"}) from None
    try:
        vectors, tokens = bytearray(), 0
        for start, chunk in _packets(inputs, m, query):
            data, used = await _embed(g, principal, m, start, chunk, query)
            vectors += data
            tokens += used
        return vectors, tokens
    finally:
        turn.release()


def _checked(inputs: list[str] | list[list[int]], m: wire.ModelInfo) -> list[str] | list[list[int]]:
    """The call's inputs, or 400 naming the first that cannot be sent (the device checks
    each text's tokens)."""
    if not inputs:
        raise ApiError(400, "input is empty: give at least one input", param="input")
    if len(inputs) > wire.MAX_EMBED_INPUTS:
        raise ApiError(400, f"input has {len(inputs)} items; at most "
                            f"{wire.MAX_EMBED_INPUTS} are embedded at once", param="input")
    for i, x in enumerate(inputs):
        if not x:
            raise ApiError(400, f"input[{i}] is empty: every input needs a token",
                           param="input")
        if isinstance(x, str):
            try:
                size = len(x.encode("utf-8"))
            except UnicodeEncodeError:
                raise ApiError(400, f"input[{i}] is not valid Unicode (lone surrogate)",
                               param="input") from None
            if size > wire.MAX_PAYLOAD - 12:
                raise ApiError(400, f"input[{i}] has {size} bytes, more than model "
                                    f"{m.alias} embeds at once", param="input",
                               code="context_length_exceeded")
        elif len(x) > m.embedding_tokens:
            raise _too_long(i, len(x), m)
    return inputs


def _too_long(index: int, tokens: int, m: wire.ModelInfo) -> ApiError:
    # The input is refused, never truncated: a cut vector would not say what was cut.
    if m.rerank:
        return ApiError(400, f"documents[{index}] with the query has {tokens} tokens; model "
                             f"{m.alias} scores at most {m.embedding_tokens} tokens of a "
                             "query and a document", param="documents",
                        code="context_length_exceeded")
    return ApiError(400, f"input[{index}] has {tokens} tokens; model {m.alias} embeds at most "
                         f"{m.embedding_tokens} tokens of one input", param="input",
                    code="context_length_exceeded")


def _packets(inputs: list[str] | list[list[int]], m: wire.ModelInfo, query: str | None = None
             ) -> list[tuple[int, list[Any]]]:
    """(index of the first input, inputs) of each EMBED packet (a reranker's: each packet
    holds the ``query`` too, and each document's input holds the query's tokens)."""
    per_reply = min(max(1, wire.MAX_PAYLOAD // (4 * m.embedding_dims)),
                    wire.MAX_EMBED_INPUTS - (query is not None))
    token_room = PACKET_DECODES * m.embedding_tokens
    lead = 8 + len(query.encode("utf-8")) if query is not None else 0
    out: list[tuple[int, list[Any]]] = []
    start, size, tokens = 0, 4 + lead, 0
    for i, x in enumerate(inputs):
        n = len(x.encode("utf-8")) if isinstance(x, str) else 4 * len(x)
        # a text's tokens are at most its bytes (and the model's limit), plus start and end
        est = min(n + lead + 2 if isinstance(x, str) else len(x), m.embedding_tokens)
        if i > start and (i - start >= per_reply or size + 8 + n > wire.MAX_PAYLOAD
                          or tokens + est > token_room):
            out.append((start, list(inputs[start:i])))
            start, size, tokens = i, 4 + lead, 0
        size, tokens = size + 8 + n, tokens + est
    out.append((start, list(inputs[start:])))
    return out


async def _embed(g: Gateway, principal: Principal, m: wire.ModelInfo, start: int,
                 chunk: list[Any], query: str | None = None) -> tuple[bytes, int]:
    """One EMBED packet: its vectors' bytes and tokens, or the refusal as an ApiError.

    The packet names itself (a random identity) and says how long it is waited for (the
    deadline less the margin for the reply's way back): the device withdraws it then,
    and at once when this task is cancelled (its client left) by an UNPARK."""
    payload = wire.encode_embed(chunk if query is None else [query, *chunk])
    deadline = g.deadlines.of(wire.Header(op=wire.Op.EMBED))
    loaded_by = time.monotonic() + LOAD_WAIT
    while True:
        h = wire.Header.request(wire.Op.EMBED, principal=principal.id, role=m.role,
                                cursor=start, identity=os.urandom(wire.IDENTITY_SIZE),
                                wait_ms=int(max(1.0, deadline - WITHDRAW_MARGIN) * 1000))
        try:
            rh, body = await g.call(h, payload, deadline)
        except BaseException:
            g.withdraw(h)
            raise
        if rh.reason != wire.Reason.MODEL_UNLOADED or time.monotonic() > loaded_by:
            break
        await asyncio.sleep(max(0.2, min(rh.retry_after, 2)))  # (its load has been asked)
    if rh.status != 200:
        if rh.reason == wire.Reason.PROMPT_LENGTH:
            raise _too_long(rh.cursor, rh.prompt_tokens, m)
        if rh.reason == wire.Reason.TOKEN_ID:
            raise ApiError(400, f"input[{rh.cursor}] holds token {rh.detail}, which is not in "
                                f"model {m.alias}'s vocabulary", param="input")
        err = refusal(rh, Call(m.alias, input_bytes=len(payload)))
        if rh.reason == wire.Reason.INPUT_BYTES:
            err.param = "documents" if query is not None else "input"
        raise err
    if len(body) != len(chunk) * 4 * m.embedding_dims:
        raise ApiError(502, "the device answered with other vectors than asked")
    return body, rh.prompt_tokens
