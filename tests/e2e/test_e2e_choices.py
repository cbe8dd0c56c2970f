"""``n`` choices end to end through the official ``openai`` client (issue 20): n choices
with their indexes, stream and not, reproducible with a seed, usage counting the prompt
once and every choice, the prompt evaluated once on the device, and the refusals."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from ..helpers import Service

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Name a colour and say why you like it. " * 4}]


def prompt_tokens_evaluated(service: Service) -> int:
    text = httpx.get(service.url + "/metrics", headers=service.headers, timeout=10).text
    m = re.search(r'^aotx_prompt_tokens_total\{model="smollm2"\} (\S+)', text, re.M)
    assert m
    return int(float(m.group(1)))


def test_n_choices_sample_apart_and_share_the_prompt(service: Service,
                                                     oai: openai.OpenAI) -> None:
    before = prompt_tokens_evaluated(service)
    r = oai.chat.completions.create(model="smollm2", messages=ASK, n=4, max_tokens=24,
                                    temperature=1.2, seed=11)
    evaluated = prompt_tokens_evaluated(service) - before
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content or "" for c in r.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage is not None
    prompt = r.usage.prompt_tokens
    # the prompt was evaluated once, plus its last token for each other choice
    assert evaluated < 2 * prompt, (evaluated, prompt)
    assert r.usage.completion_tokens >= 4 and r.usage.total_tokens == (
        prompt + r.usage.completion_tokens)
    again = oai.chat.completions.create(model="smollm2", messages=ASK, n=4, max_tokens=24,
                                        temperature=1.2, seed=11)
    assert [c.message.content for c in again.choices] == texts  # a seed reproduces them


def test_a_stream_of_n_choices_carries_their_indexes(oai: openai.OpenAI) -> None:
    texts = {0: "", 1: "", 2: ""}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in oai.chat.completions.create(
            model="smollm2", messages=ASK, n=3, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
        usage = chunk.usage or usage
    assert set(finishes) == {0, 1, 2}
    whole = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=16,
                                        temperature=0)
    # greedy: every choice is the one greedy answer
    assert set(texts.values()) == {whole.choices[0].message.content}
    assert usage is not None and usage.completion_tokens == 3 * whole.usage.completion_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("kw", [{"n": 9}, {"n": 2, "logprobs": True},
                                {"n": 0}])
def test_n_refusals(oai: openai.OpenAI, kw: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **kw)  # type: ignore[call-overload]


def test_the_native_route_takes_one_choice(service: Service) -> None:
    with service.client() as c:
        r = c.post("/aotx/v1/requests", json={"model": "smollm2", "messages": ASK, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        caps = c.get("/aotx/v1/capabilities").json()
        assert caps["limits"]["choices"] == "8"
