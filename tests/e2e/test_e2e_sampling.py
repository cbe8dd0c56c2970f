"""The sampler beyond temperature and top-p, end to end through the official ``openai``
client (issue 20): presence and frequency penalties, logit bias, and the extensions
top_k, min_p, repetition_penalty, repeat_last_n.  Each field changes what is generated
(none is accepted and ignored), and bad values answer 400."""

from __future__ import annotations

import collections
import itertools
import re
from typing import Any

import openai
import pytest

from ..helpers import Service

pytestmark = pytest.mark.e2e

REPEAT = [{"role": "user", "content": "Say 'cat cat cat cat cat cat cat cat cat cat' again."}]


def chat(oai: openai.OpenAI, messages: Any = REPEAT, **kw: Any) -> str:
    r = oai.chat.completions.create(model="smollm2", messages=messages,
                                    max_tokens=kw.pop("max_tokens", 40), **kw)
    return r.choices[0].message.content or ""


def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature(oai: openai.OpenAI) -> None:
    greedy = chat(oai, temperature=0)
    for seed in (1, 2, 3):
        assert chat(oai, temperature=1.5, seed=seed, extra_body={"top_k": 1}) == greedy
        assert chat(oai, temperature=1.5, seed=seed, extra_body={"min_p": 1.0}) == greedy
    # without them, a hot sampler wanders off the greedy text for some seed
    assert any(chat(oai, temperature=1.5, seed=s) != greedy for s in (1, 2, 3))


def test_penalties_change_a_repetitive_answer(oai: openai.OpenAI) -> None:
    plain = chat(oai, temperature=0)
    assert plain.lower().count("cat") >= 8  # the model repeats as asked
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
               {"extra_body": {"repetition_penalty": 2.0}}):
        shaped = chat(oai, temperature=0, **kw)
        assert shaped != plain, kw
        assert shaped.lower().count("cat") < plain.lower().count("cat"), (kw, shaped)
    # the penalties look at the last repeat_last_n tokens only (0: every generated one):
    # a window of 1 cannot stop a line that repeats
    poem = [{"role": "user", "content": "Write a long poem about the sea."}]
    full = chat(oai, poem, temperature=0, frequency_penalty=2.0, max_tokens=60)
    windowed = chat(oai, poem, temperature=0, frequency_penalty=2.0, max_tokens=60,
                    extra_body={"repeat_last_n": 1})
    assert windowed != full and most_repeated_pair(windowed) > most_repeated_pair(full)


def most_repeated_pair(text: str) -> int:
    """How often the text's most frequent pair of adjacent words occurs."""
    words = re.findall(r"[a-z]+", text.lower())
    return max(collections.Counter(itertools.pairwise(words)).values(), default=0)


def test_logit_bias_forces_and_forbids_a_token(oai: openai.OpenAI) -> None:
    forced = chat(oai, temperature=0, max_tokens=6, logit_bias={"330": 100})
    piece = forced[:len(forced) // 6]
    assert piece and forced == piece * 6  # the same token six times
    assert chat(oai, temperature=0, max_tokens=6) != forced
    # a banned token stays out even beside a forced one
    other = chat(oai, temperature=0, max_tokens=6, logit_bias={"331": 100})
    assert other and other != forced
    assert chat(oai, temperature=0, max_tokens=6,
                logit_bias={"330": -100, "331": 100}) == other


@pytest.mark.parametrize("kw, param", [
    ({"presence_penalty": 3}, None), ({"frequency_penalty": -2.5}, None),
    ({"logit_bias": {"cat": 1}}, None), ({"logit_bias": {"5": 101}}, None),
    ({"logit_bias": {"4000000": 1}}, "logit_bias"),
    ({"extra_body": {"min_p": 1.5}}, None), ({"extra_body": {"repetition_penalty": 0}}, None),
])
def test_bad_sampler_values_answer_400(oai: openai.OpenAI, kw: dict[str, Any],
                                       param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, temperature=0, **kw)
    assert err.value.status_code == 400
    if param:
        assert err.value.body["param"] == param  # type: ignore[index]


def test_the_native_route_carries_the_sampler(service: Service) -> None:
    with service.client() as c:
        bodies = [{"model": "smollm2", "messages": REPEAT, "max_tokens": 20, "temperature": 0,
                   **extra} for extra in ({}, {"frequency_penalty": 2.0})]
        outs = []
        for body in bodies:
            rid = c.post("/aotx/v1/requests", json=body).json()["id"]
            from .test_e2e_foundation import poll_until_terminal, read_all_windows
            poll_until_terminal(c, rid)
            outs.append(read_all_windows(c, rid))
        assert outs[0] != outs[1]
