"""``POST /v1/rerank`` end to end (issue 43): a reranker the test builds
(``tiny_reranker.py``: a BERT cross-encoder whose hand-set weights score lexical
overlap) served as ``kind = "rerank"`` beside the embedded chat model, through
llama.cpp's rank pooling, the device's EMBED, and real HTTP.

The scores are checked against llama.cpp run here on the same file, on the input
llama-server builds for a BERT reranker (``[CLS] query [SEP] document``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp
import openai
import pytest

from aotx.device.models import default_model_path

from ..helpers import SMALL_MODELS, Service, running_service
from .test_e2e_grants import mint
from .tiny_reranker import main as build_reranker

pytestmark = pytest.mark.e2e

QUERY = "What is the capital of France?"
RELEVANT = "Paris is the capital of France."
IRRELEVANT = "Bananas are a yellow fruit rich in potassium."
NEAR = "Berlin is the capital of Germany."
MODELS = SMALL_MODELS + ('\n[[model]]\nalias = "ranker"\npath = "ranker.gguf"\n'
                         'kind = "rerank"\nembedding_context = 64\n')


class Direct:
    """The reranker run in this process with llama.cpp (rank pooling), one input a
    decode: the reference the service's scores are held to."""

    def __init__(self, path: str) -> None:
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            path.encode(), llama_cpp.llama_model_default_params())
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = 64
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_RANK
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)

    def tokens(self, text: str) -> list[int]:
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, len(out), False, False)
        return list(out[:n])

    def pair(self, query: str, document: str) -> list[int]:
        return ([llama_cpp.llama_vocab_bos(self.vocab)] + self.tokens(query)
                + [llama_cpp.llama_vocab_sep(self.vocab)] + self.tokens(document))

    def score(self, query: str, document: str) -> float:
        tokens = self.pair(query, document)
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            batch.n_tokens = len(tokens)
            assert llama_cpp.llama_decode(self.ctx, batch) == 0
            return float(llama_cpp.llama_get_embeddings_seq(self.ctx, 0)[0])
        finally:
            llama_cpp.llama_batch_free(batch)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


@pytest.fixture(scope="module")
def ranked() -> Iterator[tuple[Service, Direct]]:
    def prepare(state: str) -> None:
        build_reranker([os.path.join(state, "ranker.gguf")])

    with running_service(prepare=prepare, models=MODELS) as svc:
        direct = Direct(os.path.join(svc.state_dir, "ranker.gguf"))
        try:
            yield svc, direct
        finally:
            direct.close()


def post(svc: Service, body: dict[str, Any], token: str | None = None,
         path: str = "/v1/rerank") -> httpx.Response:
    return httpx.post(svc.url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {token or svc.token}"})


def test_a_relevant_document_ranks_above_an_irrelevant_one(ranked: tuple[Service, Direct]
                                                             ) -> None:
    svc, direct = ranked
    docs = [IRRELEVANT, RELEVANT, NEAR]
    r = post(svc, {"model": "ranker", "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "ranker"
    assert body["id"].startswith("rerank-")
    assert [x["index"] for x in body["results"]] == [1, 2, 0]  # relevant, near, irrelevant
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores[0] > scores[1] > scores[2] and scores[0] - scores[2] > 0.5
    # each score is llama.cpp's rank pooling of llama-server's input, computed alone
    for x in body["results"]:
        assert abs(x["relevance_score"] - direct.score(QUERY, docs[x["index"]])) < 1e-4
    tokens = sum(len(direct.pair(QUERY, d)) for d in docs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert "document" not in body["results"][0]


def test_top_n_documents_as_objects_and_the_other_paths(ranked: tuple[Service, Direct]
                                                        ) -> None:
    svc, _ = ranked
    docs = [{"text": IRRELEVANT}, {"text": RELEVANT}, NEAR]
    body = {"query": QUERY, "documents": docs, "top_n": 2, "return_documents": True}
    r = post(svc, body)  # model left out: the caller's one reranker
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [(x["index"], x["document"]["text"]) for x in results] == [(1, RELEVANT), (2, NEAR)]
    for path in ("/rerank", "/v2/rerank"):  # llama-server's and Cohere's
        again = post(svc, {**body, "model": "ranker"}, path=path)
        assert again.status_code == 200 and again.json()["results"] == results
    # a special token's text in a document is text: no [SEP] of its own
    tricky = post(svc, {"query": QUERY, "documents": ["[SEP] paris"]}).json()
    assert tricky["usage"]["prompt_tokens"] == len(ranked[1].pair(QUERY, "[SEP] paris"))
    assert ranked[1].pair(QUERY, "[SEP] paris").count(3) == 1


def test_many_documents_go_in_several_packets(ranked: tuple[Service, Direct]) -> None:
    svc, direct = ranked
    words = "paris is the capital of france and a city on the seine river".split()
    # 60 documents of 1-12 words: with the query, about ten fit in a packet of 64 tokens
    docs = [" ".join(words[: 1 + i % 12]) + f" {'cat ' * (i % 5)}" for i in range(60)]
    r = post(svc, {"model": "ranker", "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert sorted(got) == list(range(60))
    for i in range(0, 60, 7):
        assert abs(got[i] - direct.score(QUERY, docs[i])) < 1e-4, i
    ordered = [x["relevance_score"] for x in r.json()["results"]]
    assert ordered == sorted(ordered, reverse=True)


def test_what_a_reranker_refuses_and_what_refuses_it(ranked: tuple[Service, Direct]) -> None:
    svc, _ = ranked
    oai = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0,
                        timeout=60)
    listed = {m.id: m.model_dump() for m in oai.models.list().data}
    assert listed["ranker"]["rerank"] is True and listed["ranker"]["embeddings"] is None
    assert listed["ranker"]["chat"] is False and listed["smollm2"]["rerank"] is False
    caps = httpx.get(svc.url + "/aotx/v1/capabilities",
                     headers={"Authorization": f"Bearer {svc.token}"}).json()
    assert caps["features"]["rerank"] is True and caps["features"]["embeddings"] is True
    with pytest.raises(openai.BadRequestError, match="a reranker"):
        oai.embeddings.create(model="ranker", input="paris")
    with pytest.raises(openai.NotFoundError, match="is a reranker"):
        oai.chat.completions.create(model="ranker", messages=[{"role": "user", "content": "x"}])
    cases = [
        ({"model": "smollm2", "query": QUERY, "documents": [RELEVANT]}, "not a reranker"),
        ({"model": "ranker", "query": QUERY, "documents": []}, "documents"),
        ({"model": "ranker", "query": "", "documents": [RELEVANT]}, "query"),
        ({"model": "ranker", "query": QUERY, "documents": [""]}, "documents[0] is empty"),
        ({"model": "ranker", "query": QUERY, "documents": [RELEVANT], "texts": ["x"]}, "texts"),
        ({"model": "ranker", "query": QUERY, "documents": [RELEVANT], "top_n": 0}, "top_n"),
    ]
    for body, why in cases:
        r = post(svc, body)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (body, r.text)
    # a document that with the query is longer than the reranker's 64 tokens: refused whole
    r = post(svc, {"model": "ranker", "query": QUERY, "documents": [RELEVANT, "cat " * 60]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert err["param"] == "documents" and "documents[1]" in err["message"]


def test_another_principal_gets_the_same_404s(ranked: tuple[Service, Direct]) -> None:
    svc, _ = ranked
    token = mint(svc, "kim", "--models", "smollm2")
    r = post(svc, {"model": "ranker", "query": QUERY, "documents": [RELEVANT]}, token)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(svc, {"query": QUERY, "documents": [RELEVANT]}, token)
    assert r.status_code == 400 and "0 rerankers" in r.json()["error"]["message"]
    assert "ranker" not in {m["id"] for m in httpx.get(
        svc.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}).json()["data"]}


def test_a_models_folders_reranker_loads_on_its_first_call() -> None:
    """A reranker put in the models folder is one by its file (its GGUF declares rank
    pooling), listed unloaded, and loaded by its first /v1/rerank call; a chat model's
    file there is loaded by its first /v1/embeddings call alike."""
    def folder(state: str) -> None:
        models = os.path.join(state, "models")
        os.makedirs(models)
        build_reranker([os.path.join(models, "lexical.gguf")])
        os.link(default_model_path(), os.path.join(models, "copy.gguf"))

    with running_service(folder) as svc:
        headers = {"Authorization": f"Bearer {svc.token}"}
        listed = {m["id"]: m for m in httpx.get(svc.url + "/v1/models", headers=headers)
                  .json()["data"]}
        assert listed["lexical"]["rerank"] is True and listed["lexical"]["chat"] is False
        assert listed["lexical"]["status"]["value"] == "unloaded"
        assert listed["copy"]["chat"] is True and listed["copy"]["rerank"] is False
        r = post(svc, {"model": "lexical", "query": QUERY, "documents": [IRRELEVANT, RELEVANT]})
        assert r.status_code == 200, r.text
        assert [x["index"] for x in r.json()["results"]] == [1, 0]
        e = httpx.post(svc.url + "/v1/embeddings", json={"model": "copy", "input": "a"},
                       headers=headers, timeout=120)
        assert e.status_code == 200 and len(e.json()["data"][0]["embedding"]) == 576, e.text
        status = {m["id"]: m["status"]["value"] for m in httpx.get(
            svc.url + "/v1/models", headers=headers).json()["data"]}
        assert status["lexical"] == status["copy"] == "loaded"
