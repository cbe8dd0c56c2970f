"""Conversations' KV kept beyond the sequences that hold it (issue 22), end to end on the
real service: with one sequence, each user's turn takes the sequence from the one before,
whose cells go to host memory (llama_state_seq_get_data) and come back on its next turn
(llama_state_seq_set_data).  The restored turn answers as the same turn evaluated from
nothing does, and another principal's identical prompt never restores what is not its own."""

from __future__ import annotations

import openai
import pytest

from ..helpers import Service, running_service
from .test_e2e_grants import mint
from .test_e2e_kv_pool import metric

pytestmark = pytest.mark.e2e

SYSTEM = ("You are a patient tutor for a student who is learning about the natural world. "
          "Explain one idea at a time in plain words, give a small everyday example, and "
          "check that the student followed before going further. Avoid lists and headings. "
          "When the student is wrong, say what was right in the answer first. Keep every "
          "answer under a hundred words, and end with a short question back to the student.")


def ask(svc: Service, token: str, messages: list[dict[str, str]]) -> str:
    oai = openai.OpenAI(base_url=svc.url + "/v1", api_key=token, max_retries=0, timeout=300)
    r = oai.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                    messages=messages)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


def conversation(svc: Service) -> tuple[str, str]:
    """alice's turn, bob's, alice's next turn: (alice's first answer, her second)."""
    alice, bob = mint(svc, "alice"), mint(svc, "bob")
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Why is the sky blue?"}]
    reply = ask(svc, alice, first)
    ask(svc, bob, [{"role": "system", "content": "You answer in one sentence."},
                   {"role": "user", "content": "Name three rivers in Europe."}])
    return reply, ask(svc, alice, [*first, {"role": "assistant", "content": reply},
                                   {"role": "user", "content": "And why is the sunset red?"}])


def test_a_turn_whose_sequence_was_reused_restores_its_history() -> None:
    """The same three turns on two services.  With two sequences bob takes the empty one
    and alice's history stays in hers.  With one, bob's turn takes alice's sequence, so
    her history goes to host memory, and her next turn restores it: the same cells and the
    same new tokens evaluated, so exactly the same answer.  carol, sending alice's exact
    conversation, restores nothing (alice's cells are not hers)."""
    with running_service(models="[default]\nslots = 2\ncontext = 2048\nkv_spill = 0\n") as kept_svc:
        kept = conversation(kept_svc)
        assert metric(kept_svc, "aotx_kv_spills_total") == 0
    with running_service(models="[default]\nslots = 1\ncontext = 2048\n") as svc:
        reply, restored = conversation(svc)
        assert reply == kept[0]
        assert metric(svc, "aotx_kv_spills_total") == 1  # alice's ~110 cells, for bob's turn
        assert metric(svc, "aotx_kv_restores_total") == 1
        assert restored and restored == kept[1]
        second = [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Why is the sky blue?"},
                  {"role": "assistant", "content": reply},
                  {"role": "user", "content": "And why is the sunset red?"}]
        assert metric(svc, "aotx_kv_spilled_bytes") == 0  # alice's went back to a sequence
        fresh = ask(svc, mint(svc, "carol"), second)
        assert metric(svc, "aotx_kv_restores_total") == 1
        assert metric(svc, "aotx_kv_spills_total") == 2  # alice's two turns, for carol's
        assert metric(svc, "aotx_kv_spilled_bytes") > 150 * 23040
    # And as the whole conversation evaluated at once.  That holds for this conversation
    # on this build, not for every one: llama.cpp's CPU arithmetic depends on the batch
    # (the reply's cells were decoded one by one), so a near tie can go the other way,
    # with a prefix kept in its sequence as with one restored ("...red then?" did).
    assert fresh == restored
