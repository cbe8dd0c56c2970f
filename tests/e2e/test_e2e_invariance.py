"""A long prompt's answer (its tokens and their logprobs, to the bit) is the same alone,
as one of ``n`` choices and beside other requests, through the service and the official
``openai`` client: without flash attention (``flash_attention = false``), and with it (the
default) on aotx's build of llama.cpp, where every row, a prompt's or a decode step's, takes
one tiled path that computes it the same whatever chunk it came in
(scripts/llama-flash-attention.patch).
An upstream build's flash attention does not keep this: the prompt's chunks fall
otherwise with other streams running or a prefix cached, and a deep stream decoding alone
splits its cache across threads.  And without flash attention a later turn is not
widened (chunking.py)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import openai
import pytest

from ..helpers import SMALL_MODELS, Service, running_service
from .test_e2e_chunking import later_turn

pytestmark = pytest.mark.e2e

COLORS = ["red", "blue", "green"]
LONG = (" ".join(f"Item {i} is colored {COLORS[i % 3]}." for i in range(70))
        + " What color is item 7?")


def answer(oai: openai.OpenAI, content: str, n: int = 1, max_tokens: int = 8,
           seed: int | None = None) -> list[tuple[str, list[float]]]:
    out = oai.chat.completions.create(model="smollm2", messages=[{"role": "user",
                                                                  "content": content}],
                                      temperature=1.0 if seed is not None else 0,
                                      seed=seed, max_tokens=max_tokens, n=n, logprobs=True)
    assert out.usage is not None and (content != LONG or out.usage.prompt_tokens > 550)
    return [(c.message.content or "", [t.logprob for t in c.logprobs.content or []])
            for c in out.choices if c.logprobs is not None]


@pytest.fixture(scope="module", params=["flash_attention = false\n", ""],
                ids=["no-flash-attention", "flash-attention"])
def invariant(request: pytest.FixtureRequest) -> Iterator[Service]:
    with running_service(models=SMALL_MODELS + request.param) as svc:
        yield svc


def client(svc: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0,
                         timeout=120)


def test_a_long_prompt_answers_the_same_alone_as_a_choice_and_beside_others(
        invariant: Service) -> None:
    oai = client(invariant)
    alone = answer(oai, LONG)[0]
    seeded = answer(oai, LONG, seed=11, max_tokens=12)[0]
    assert alone[0] and len(alone[1]) > 1
    assert answer(oai, LONG, n=3) == [alone] * 3
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # streams decoding (one deep) while the long prompt is evaluated, in each order
        others = [pool.submit(answer, oai, "Count slowly from one to forty.", 1, 96),
                  pool.submit(answer, oai, LONG + " And item 8?", 1, 64)]
        beside = [pool.submit(answer, oai, LONG), pool.submit(answer, oai, LONG, 1, 12, 11)]
        assert [f.result() for f in beside] == [[alone], [seeded]]
        assert all(f.result()[0][0] for f in others)


def test_a_later_turn_evaluates_its_own_tokens(invariant: Service) -> None:
    new, evaluated = later_turn(invariant, client(invariant))
    assert new <= evaluated < 64, (evaluated, new)  # nothing widened to a tile
