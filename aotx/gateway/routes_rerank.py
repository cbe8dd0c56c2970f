"""``POST /v1/rerank`` (also ``/rerank``, llama-server's, and ``/v2/rerank``, Cohere's):
documents scored against a query by a reranker (a models file's ``kind = "rerank"``).

The body is Jina's and Cohere's: ``query``, ``documents`` (strings, or objects with a
``text``), ``top_n`` and ``return_documents``.  The scores come from the device's EMBED
on the reranker (device/embeddings.py): each packet holds the query and some documents,
and each document is scored as one input with the query, through llama.cpp's rank
pooling.  ``relevance_score`` is the model's own score (its classifier head's output, as
llama-server reports it, not squashed into 0..1); the results are ordered by it, highest
first, ties in the documents' order.
"""

from __future__ import annotations

import os
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from .. import wire
from . import schemas as S
from .body import Body
from .errors import ApiError
from .render import json_response
from .routes_embeddings import embed_all
from .service import Caller, Gateway, Principal, Service, until_disconnected

router = APIRouter(tags=["standard"], redirect_slashes=False)
#: Documents one call may score (Cohere's recommended most; each is an input of its own).
MAX_DOCUMENTS = 1000


class Document(Body):
    text: str


class RerankRequest(Body):
    """The body of ``POST /v1/rerank``; a field not listed here is refused (400)."""

    model: str | None = Field(default=None, min_length=1, max_length=256,
                              description="may be left out when the caller sees one reranker")
    query: Annotated[str, Field(min_length=1)]
    documents: list[str | Document] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(default=None, ge=1, description="the best n (default: all)")
    return_documents: bool = False  # each result's document text, as {"text": ...}

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


def reranker(g: Gateway, alias: str | None, principal: Principal) -> wire.ModelInfo:
    """The reranker named, or the caller's one reranker when none is named."""
    if alias is None:
        models = [m for m in g.visible_models(principal) if m.rerank]
        if len(models) != 1:
            raise ApiError(400, f"model is required: this caller may use {len(models)} "
                                "rerankers", param="model")
        return models[0]
    m = g.model_for(alias, principal)
    if not m.rerank:
        raise ApiError(400, f"model {m.alias!r} is not a reranker (a models file entry of "
                            "kind = \"rerank\", or a reranker's GGUF in the models folder)",
                       param="model")
    return m


def _checked(query: str, texts: list[str], m: wire.ModelInfo) -> None:
    """400 naming what cannot be sent: an empty or invalid text, or one that with the query
    does not fit a packet (the device checks each input's tokens)."""
    def size(text: str, where: str) -> int:
        try:
            return len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise ApiError(400, f"{where} is not valid Unicode (lone surrogate)",
                           param=where.split("[")[0]) from None

    room = wire.MAX_PAYLOAD - 24 - size(query, "query")
    for i, text in enumerate(texts):
        if not text:
            raise ApiError(400, f"documents[{i}] is empty", param="documents")
        if size(text, f"documents[{i}]") > room:
            raise ApiError(400, f"documents[{i}] with the query is longer than model "
                                f"{m.alias} scores at once", param="documents",
                           code="context_length_exceeded")


@router.post("/v1/rerank", response_model=S.RerankList)
@router.post("/v2/rerank", response_model=S.RerankList, include_in_schema=False)
@router.post("/rerank", response_model=S.RerankList, include_in_schema=False)
async def rerank(body: RerankRequest, request: Request, principal: Principal = Caller,
                 g: Gateway = Service) -> Response:
    await g.ensure_ready()
    m = reranker(g, body.model, principal)
    texts = body.texts()
    _checked(body.query, texts, m)
    data, tokens = await until_disconnected(
        request, embed_all(g, principal, m, texts, query=body.query))
    scores = np.frombuffer(bytes(data), "<f4").astype(np.float64)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": texts[i]}} if body.return_documents else {})}
               for i in order]
    return json_response({"id": f"rerank-{os.urandom(12).hex()}", "object": "list",
                          "model": m.alias, "results": results,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
