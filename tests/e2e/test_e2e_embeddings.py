"""``POST /v1/embeddings`` end to end through the official ``openai`` client (issue 21): the
real SmolLM2 GGUF through llama.cpp (mean pooling in an embedding context of its own),
real HTTP, the device's EMBED operation."""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp
import numpy as np
import openai
import pytest

from aotx.device.models import default_model_path

from ..helpers import SMALL_MODELS, Service, running_service
from .test_e2e_grants import mint

pytestmark = pytest.mark.e2e

SIMILAR = ("The cat sat on the mat.", "A kitten was sitting on the rug.")
UNRELATED = "Quarterly revenue grew by ten percent in the last fiscal year."


def tokenize(text: str) -> list[int]:
    """The model's own tokens of ``text`` (its vocabulary only, through llama.cpp): what
    the device embeds for a text input, start and end tokens included as the vocabulary
    says, special-token texts left as text."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(default_model_path().encode(), params)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), out, len(out), True, False)
        return list(out[:n])
    finally:
        llama_cpp.llama_model_free(model)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same unit vectors within float rounding: llama.cpp's CPU kernels sum in another
    order for another batch shape (an input beside others moves by about 1e-3)."""
    return bool(np.abs(a - b).max() < 5e-3 and ((a * b).sum(-1) > 0.9999).all())


def vectors(oai: openai.OpenAI, inputs: Any, model: str = "smollm2", **kw: Any) -> np.ndarray:
    r = oai.embeddings.create(model=model, input=inputs, **kw)
    assert [d.index for d in r.data] == list(range(len(r.data)))
    return np.array([d.embedding for d in r.data], dtype=np.float64)


def raw(service: Service, body: dict[str, Any], token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token or service.token}"}
    return httpx.post(service.url + "/v1/embeddings", json=body, headers=headers, timeout=120)


def test_both_encodings_give_the_same_unit_vectors(service: Service, oai: openai.OpenAI) -> None:
    body = {"model": "smollm2", "input": list(SIMILAR)}
    floats = raw(service, {**body, "encoding_format": "float"}).json()
    b64 = raw(service, {**body, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        assert decoded.tolist() == f["embedding"]  # exactly: the float32 values as doubles
        assert len(decoded) == 576 and abs(float(np.linalg.norm(decoded)) - 1) < 1e-5
    assert floats["usage"] == b64["usage"] and floats["model"] == "smollm2"
    # null is the default, as for every other optional field
    assert raw(service, {**body, "encoding_format": None}).json()["data"] == floats["data"]
    # the SDK asks base64 by default and decodes it itself
    assert np.array_equal(vectors(oai, list(SIMILAR)), np.array(
        [f["embedding"] for f in floats["data"]]))


def test_a_batch_equals_its_inputs_one_by_one(oai: openai.OpenAI) -> None:
    texts = [*SIMILAR, UNRELATED, "hello", "Paris is the capital of France. " * 12]
    batch = vectors(oai, texts)
    alone = np.concatenate([vectors(oai, t) for t in texts])
    assert batch.shape == (5, 576)
    assert same(batch, alone)  # other sequences in a decode change only the rounding


def test_similar_sentences_are_closer_than_unrelated_ones(oai: openai.OpenAI) -> None:
    a, b, c = vectors(oai, [*SIMILAR, UNRELATED])
    assert a @ b > a @ c + 0.1 and a @ b > b @ c + 0.1  # unit vectors: dot = cosine


def test_token_arrays_embed_as_their_text_and_usage_counts_tokens(oai: openai.OpenAI) -> None:
    tokens = [tokenize(t) for t in SIMILAR]
    r = oai.embeddings.create(model="smollm2", input=list(SIMILAR))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, tokens))
    by_tokens = vectors(oai, tokens)
    assert same(by_tokens, np.array([d.embedding for d in r.data]))
    one = oai.embeddings.create(model="smollm2", input=tokens[0])  # one token array
    assert one.usage.prompt_tokens == len(tokens[0])
    assert same(np.array(one.data[0].embedding), by_tokens[0])


def test_a_call_larger_than_a_packet_keeps_its_order(oai: openai.OpenAI) -> None:
    texts = [f"Item number {i} of the list." for i in range(70)]  # 28 vectors fit a packet
    many = vectors(oai, texts)
    assert many.shape == (70, 576)
    for i in (0, 27, 28, 69):
        assert same(many[i], vectors(oai, texts[i])[0])


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "dimensions": 64}, "dimensions", "does not support dimensions"),
    ({"input": ["fine", "word " * 600]}, "input", "input[1] has 601 tokens"),
    ({"input": [[5] * 513]}, "input", "input[0] has 513 tokens"),
    ({"input": ["ok", ""]}, "input", "input[1] is empty"),
    ({"input": []}, "input", "input is empty"),
    ({"input": [[1, 2, 9_000_000]]}, "input", "token 9000000"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "hi", "truncate": True}, "truncate", "Extra inputs"),
])
def test_bad_calls_answer_400_naming_the_field(service: Service, body: dict[str, Any],
                                                param: str, words: str) -> None:
    r = raw(service, {"model": "smollm2", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err


def test_the_user_field_is_accepted(oai: openai.OpenAI) -> None:
    assert len(vectors(oai, "hi", user="someone")[0]) == 576


def test_grants_apply_the_model_mask_and_the_rate(service: Service) -> None:
    masked = mint(service, "emb-masked", "--models", "other-model")
    r = raw(service, {"model": "smollm2", "input": "hi"}, masked)
    chat = httpx.post(service.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {masked}"},
                      json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 == chat.status_code and r.json() == chat.json()
    slow = mint(service, "emb-rate", "--limit", "rate=1")
    texts = [f"sentence {i}" for i in range(60)]  # three packets: one admission
    before = counts(service)
    first = raw(service, {"model": "smollm2", "input": texts}, slow)
    assert first.status_code == 200 and len(first.json()["data"]) == 60
    again = raw(service, {"model": "smollm2", "input": "hi"}, slow)
    assert again.status_code == 429 and int(again.headers["retry-after"]) >= 1
    # /metrics counts the calls as it counts submissions: one admitted, one refused
    after = counts(service)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def counts(service: Service) -> tuple[float, float]:
    """aotx_requests_admitted_total and aotx_requests_refused_total{status="429"}."""
    text = httpx.get(service.url + "/metrics", headers=service.headers, timeout=30).text
    admitted = re.search(r"^aotx_requests_admitted_total (\S+)$", text, re.M)
    refused = re.search(r'^aotx_requests_refused_total\{status="429"\} (\S+)$', text, re.M)
    assert admitted is not None
    return float(admitted[1]), float(refused[1]) if refused else 0.0


def test_models_and_capabilities_list_the_embeddings(service: Service) -> None:
    with service.client() as c:
        (m,) = c.get("/v1/models").json()["data"]
        caps = c.get("/aotx/v1/capabilities").json()
    want = {"dimensions": 576, "max_input_tokens": 512}
    assert m["embeddings"] == want and m["chat"] is True
    assert caps["models"][0]["embeddings"] == want and caps["features"]["embeddings"] is True
    assert caps["limits"]["embedding_inputs"] == "2048"


def test_streams_keep_going_while_a_big_batch_is_embedded(service: Service,
                                                          oai: openai.OpenAI) -> None:
    """The engine thread embeds between decode steps, one bounded decode at a time: a
    stream's tokens keep coming while a large batch is embedded."""
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in oai.chat.completions.create(
                model="smollm2", stream=True, temperature=0, max_tokens=400,
                messages=[{"role": "user", "content": "Count from 1 to 300, one per line."}]):
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    texts = [f"Sentence {i}: the quick brown fox jumps over the lazy dog near the river "
             f"bank while {i} birds sing." for i in range(160)]
    t0 = time.monotonic()
    assert vectors(oai, texts).shape == (160, 576)
    t1 = time.monotonic()
    t.join(120)
    during = [a for a in arrivals if t0 <= a <= t1]
    gaps = np.diff([t0, *during])
    print(f"embedding {t1 - t0:.1f} s, tokens meanwhile {len(during)}, "
          f"largest gap {gaps.max():.2f} s")
    assert len(during) >= 5  # the stream went on while the batch was embedded
    assert gaps.max() < max(4.0, (t1 - t0) / 4)  # never stalled for the batch's duration


@pytest.fixture(scope="module")
def two_models() -> Iterator[Service]:
    """The default chat model and, from the models file, the same GGUF declared as an
    embedding model (kind = "embedding": pooling from the GGUF, mean where it says none)."""
    models = SMALL_MODELS + (f'\n[[model]]\nalias = "emb"\npath = "{default_model_path()}"\n'
                             'kind = "embedding"\nembedding_context = 256\n')
    with running_service(models=models) as svc:
        yield svc


def test_an_embedding_model_from_the_models_file(two_models: Service) -> None:
    oai = openai.OpenAI(base_url=two_models.url + "/v1", api_key=two_models.token,
                        max_retries=0, timeout=120)
    listed = {m.id: m.model_dump() for m in oai.models.list().data}
    assert listed["emb"]["chat"] is False and listed["smollm2"]["chat"] is True
    assert listed["emb"]["embeddings"] == {"dimensions": 576, "max_input_tokens": 256}
    # the same weights and mean pooling: the same vectors
    assert same(vectors(oai, list(SIMILAR), "emb"), vectors(oai, list(SIMILAR)))
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:  # the same words on /v1/completions
        oai.completions.create(model="emb", prompt="hi")
    assert "embedding model" in err.value.message
    with pytest.raises(openai.BadRequestError, match="at most 256"):
        oai.embeddings.create(model="emb", input=[[7] * 257])


def test_the_tokenizer_helper_matches_the_device(oai: openai.OpenAI) -> None:
    # (the tokens above are the device's: the usage of a text equals its helper count)
    text = "<|im_start|> stays text"
    r = oai.embeddings.create(model="smollm2", input=text)
    assert r.usage.prompt_tokens == len(tokenize(text)) > 3
