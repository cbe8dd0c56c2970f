"""A later turn of a long conversation through the service and the official ``openai``
client: the device evaluates only its short new part over the cached conversation, a
chunk that aotx's build of llama.cpp tiles (every chunk does; an upstream build would
widen it to 65 tokens, engine/chunking.py), and counts it in ``aotx_prompt_tokens_total``; the
same with several prompts a step (``prompts_per_step = 0``)."""

from __future__ import annotations

import openai
import pytest

from aotx.engine.llama.chunking import FA_TILE, fa_tile_min_rows

from ..helpers import SMALL_MODELS, Service, running_service
from .test_e2e_choices import prompt_tokens_evaluated
from .test_engine_chunking import FOLLOW_UP, STORY

pytestmark = pytest.mark.e2e


def later_turn(service: Service, oai: openai.OpenAI) -> tuple[int, int]:
    """A long first turn, then its history and a short follow-up: (the follow-up's new
    tokens, the prompt tokens the device evaluated for it)."""
    first_turn = [{"role": "user", "content": STORY + " How many ships on day 4?"}]
    first = oai.chat.completions.create(model="smollm2", messages=first_turn,  # type: ignore[arg-type]
                                        max_tokens=16, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 500
    history = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": FOLLOW_UP}]
    before = prompt_tokens_evaluated(service)
    later = oai.chat.completions.create(model="smollm2", messages=history,  # type: ignore[arg-type]
                                        max_tokens=8, temperature=0)
    evaluated = prompt_tokens_evaluated(service) - before
    assert later.usage is not None
    new = later.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert 0 < new < FA_TILE  # the turn's own tokens: fewer than a tile
    assert later.choices[0].message.content
    return new, evaluated


def test_a_later_turn_evaluates_only_its_new_tokens_over_the_cached_conversation(
        service: Service, oai: openai.OpenAI) -> None:
    new, evaluated = later_turn(service, oai)
    assert fa_tile_min_rows() <= new <= evaluated <= new + 2, (evaluated, new)  # (and the
    # template's end of the reply, which stopped at max_tokens): one chunk, tiled


def test_with_several_prompts_a_step_chunks_are_not_widened() -> None:
    # An upstream build widens nothing then (llama.cpp would split two prompts of a step
    # into equal rows); aotx's build widens nothing at all, and holds one prompt a step
    with running_service(models=SMALL_MODELS + "prompts_per_step = 0\n") as svc:
        oai = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0,
                            timeout=120)
        new, evaluated = later_turn(svc, oai)
    assert new <= evaluated <= new + 2 < FA_TILE, (evaluated, new)  # its own tokens (and
    # the template's end of the reply), not a tile
