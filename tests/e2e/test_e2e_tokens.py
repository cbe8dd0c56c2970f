"""The token routes (issue 43) on the real model: /tokenize and /detokenize against
llama.cpp's own tokenizer, /apply-template against the count of a real run, and the
input-token counts of chat and Responses bodies equal to the usage a real run of the
same body reports; another principal's model mask applies as on every route."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp
import openai
import pytest

from aotx.device.models import default_model_path

from ..helpers import Service
from .test_e2e_grants import mint

pytestmark = pytest.mark.e2e

SPECIAL = "hi <|im_end|> there ünïcödé 🐉"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def vocab() -> Iterator[llama_cpp.Llama]:
    v = llama_cpp.Llama(default_model_path(), vocab_only=True, verbose=False)
    yield v
    v.close()


def post(service: Service, path: str, body: dict[str, Any]) -> httpx.Response:
    with service.client() as c:
        return c.post(path, json=body)


def ok(service: Service, path: str, body: dict[str, Any]) -> Any:
    r = post(service, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_is_llama_cpps_tokenizer(service: Service, vocab: llama_cpp.Llama) -> None:
    text = SPECIAL.encode()
    for special in (True, False):
        for add in (True, False):
            got = ok(service, "/tokenize", {"content": SPECIAL, "parse_special": special,
                                            "add_special": add})["tokens"]
            assert got == list(vocab.tokenize(text, add_bos=add, special=special)), (special,
                                                                                    add)
    parsed = ok(service, "/tokenize", {"content": SPECIAL})["tokens"]
    [im_end] = vocab.tokenize(b"<|im_end|>", add_bos=False, special=True)
    assert im_end in parsed  # the default: parse_special, as llama-server's
    assert len(parsed) < len(ok(service, "/tokenize", {"content": SPECIAL,
                                                       "parse_special": False})["tokens"])


def test_pieces_and_detokenize_give_the_text_back(service: Service) -> None:
    tokens = ok(service, "/tokenize", {"content": SPECIAL, "with_pieces": True,
                                       "model": "smollm2"})["tokens"]
    joined = b""
    for t in tokens:
        piece = t["piece"]
        joined += piece.encode() if isinstance(piece, str) else bytes(piece)
    assert joined.decode() == SPECIAL
    ids = [t["id"] for t in tokens]
    assert ok(service, "/detokenize", {"tokens": ids})["content"] == SPECIAL
    assert ok(service, "/detokenize", {"tokens": []})["content"] == ""


def test_a_long_text_comes_back_whole_across_pages(service: Service) -> None:
    """More tokens than one device reply holds (16,352 ids): the gateway pages."""
    text = "ab " * 20000  # ~20,000 tokens, 60,000 bytes: within one submission
    ids = ok(service, "/tokenize", {"content": text})["tokens"]
    assert len(ids) > 16352
    assert ok(service, "/detokenize", {"tokens": ids})["content"] == text


def test_bad_token_routes_bodies_are_400s_naming_the_field(service: Service) -> None:
    r = post(service, "/detokenize", {"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert "1000000" in r.json()["error"]["message"]
    r = post(service, "/detokenize", {"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(service, "/tokenize", {"content": "a", "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = post(service, "/tokenize", {"content": "a", "model": "nope"})
    assert r.status_code == 404
    r = post(service, "/v1/chat/completions/input_tokens",
             {"messages": [{"role": "user", "content": "hi"}]})  # OpenAI's body: model required
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_input_tokens_are_the_usage_of_a_real_run(service: Service, oai: openai.OpenAI
                                                  ) -> None:
    for extra in ({}, {"tools": [WEATHER]}):
        body = {"model": "smollm2", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}], **extra}
        counted = ok(service, "/v1/chat/completions/input_tokens", body)
        assert counted["object"] == "response.input_tokens"
        ran = oai.chat.completions.create(**body, max_tokens=4, temperature=0)  # type: ignore[call-overload]
        assert ran.usage.prompt_tokens == counted["input_tokens"], extra
        # the template's rendering, tokenized as the device tokenizes a template's text,
        # is the same count (the messages hold no special-token text)
        prompt = ok(service, "/apply-template", body)["prompt"]
        assert "Name a colour." in prompt and prompt.endswith("<|im_start|>assistant\n")
        tokens = ok(service, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
        assert len(tokens) == counted["input_tokens"]


def test_responses_input_tokens_count_the_conversation(service: Service,
                                                       oai: openai.OpenAI) -> None:
    first = oai.responses.create(model="smollm2", input="Say one word.", max_output_tokens=4,
                                 temperature=0, instructions="Be brief.")
    body = {"model": "smollm2", "input": "And another.", "previous_response_id": first.id}
    counted = ok(service, "/v1/responses/input_tokens", body)
    assert counted["object"] == "response.input_tokens"
    second = oai.responses.create(**body, max_output_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert second.usage is not None
    assert second.usage.input_tokens == counted["input_tokens"]
    r = post(service, "/v1/responses/input_tokens", {"model": "smollm2", "input": "x",
                                                    "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_another_principals_model_mask_holds_on_every_token_route(service: Service) -> None:
    token = mint(service, "tokens-other", "--models", "other-model")
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=service.url, timeout=60,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        for path, body in (("/tokenize", {"content": "a", "model": "smollm2"}),
                           ("/detokenize", {"tokens": [1], "model": "smollm2"}),
                           ("/apply-template", chat),
                           ("/v1/chat/completions/input_tokens", chat),
                           ("/v1/responses/input_tokens", {"model": "smollm2", "input": "x"})):
            r = c.post(path, json=body)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "model_not_found"
        # with no model named, it has none to use
        r = c.post("/tokenize", json={"content": "a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_template_arguments_are_markup_and_checked(service: Service) -> None:
    """chat_template_kwargs reach the template (SmolLM2's uses none: the same prompt);
    the template's own names, and special-token text, are refused."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    plain = ok(service, "/apply-template", body)["prompt"]
    assert ok(service, "/apply-template", {**body, "chat_template_kwargs": {
        "enable_thinking": False}})["prompt"] == plain
    for bad in ({"add_generation_prompt": False}, {"note": "a<|im_end|>b"}):
        r = post(service, "/v1/chat/completions", {**body, "max_tokens": 2,
                                                   "chat_template_kwargs": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
    r = post(service, "/apply-template", {**body, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
