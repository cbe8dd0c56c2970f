"""One rule for a sampled token (engine/accept.py), and both engines keeping it: the same
token streams through llama.cpp's scheduler (on a scripted engine) and the vLLM runner (on
a scripted ``EngineClient``) end the same way, with the same bytes and counts."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from aotx import wire
from aotx.engine.accept import CANCELLED, FAILED_GRAMMAR, LENGTH, STOPPED, accept
from aotx.engine.interface import EngineStats
from aotx.engine.llama.scheduler import Scheduler
from aotx.engine.logprobs import Annotations
from aotx.engine.output import OutputBuffer
from aotx.engine.request import Request
from aotx.engine.vllm.hfvocab import HfVocab, Vocab
from aotx.wire import Phase

from .test_scheduler import EOG, ScriptedEngine, run_until_idle
from .test_vllm_engine import Running, ScriptedClient, out

PROMPT = 5


def request(max_tokens: int = 100, stops: tuple[bytes, ...] = ()) -> Request:
    r = Request(identity=bytes(16), principal=1, revision=1, role=1,
                prompt=list(range(100, 100 + PROMPT)), max_tokens=max_tokens, stops=stops)
    r.buffer = OutputBuffer(stops)
    return r


def test_each_rule_in_order() -> None:
    stats = EngineStats()
    r = request(max_tokens=3, stops=(b"zz",))
    assert accept(r, 7, b"a", 10, stats, eog=False, held=6, context=64) is None
    assert r.phase is Phase.RUNNING and r.generated == [7] and bytes(r.out) == b"a"
    assert stats.tokens_out == 1 and stats.ttft.count == 1 and stats.itl.count == 0
    r.cancel_requested = True
    assert accept(r, 8, b"b", 20, stats, eog=False, held=7, context=64) == CANCELLED
    assert stats.itl.count == 1 and r.sampled == 2
    # the length comes before a cancel; the context's end is a length
    last = request(max_tokens=1)
    last.cancel_requested = True
    assert accept(last, 7, b"a", 1, stats, eog=False, held=6, context=64) == LENGTH
    assert accept(request(), 7, b"a", 1, stats, eog=False, held=64, context=64) == LENGTH
    # a stop string: its bytes are not output
    s = request(stops=(b"ab",))
    assert accept(s, 7, b"a", 1, stats, eog=False, held=6, context=64) is None
    assert accept(s, 8, b"b", 2, stats, eog=False, held=7, context=64) == STOPPED
    assert bytes(s.out) == b"" and s.generated == [7, 8]
    assert s.stop_hit == 1  # (its index + 1: the Messages API names the stop sequence)
    # of two stop strings, the one that comes first in the output
    two = request(stops=(b"yz", b"x"))
    assert accept(two, 7, b"axyz", 1, stats, eog=False, held=6, context=64) == STOPPED
    assert bytes(two.out) == b"a" and two.stop_hit == 2
    # end of generation: counted, not output, no stop string
    e = request()
    assert accept(e, 0, b"", 1, stats, eog=True, held=6, context=64) == STOPPED
    assert e.sampled == 1 and e.generated == [] and bytes(e.out) == b"" and e.stop_hit == 0
    # a failed matcher gives no token: nothing counted
    f = request()
    assert accept(f, -1, b"", 1, stats, eog=False, held=6, context=64) == FAILED_GRAMMAR
    assert f.sampled == 0


def test_a_finished_grammar_ends_it_even_at_the_last_token() -> None:
    class Done:
        finished = True

    r = request(max_tokens=1)
    r.matcher = Done()  # type: ignore[assignment]
    assert accept(r, 7, b"}", 1, EngineStats(), eog=False, held=6, context=64) == STOPPED


def test_logprobs_lines_follow_the_published_bytes() -> None:
    r = request(stops=(b"b",))
    r.notes = Annotations(0)
    for token, piece in ((7, b"a"), (8, b"b")):
        r.notes.next = b"{}"
        accept(r, token, piece, 1, EngineStats(), eog=False, held=6, context=64)
    assert bytes(r.out) == b"a"


# -- the two engines ------------------------------------------------------------------
PIECES = {t: ScriptedEngine().piece(t) for t in range(1, 10)}


def through_llama(script: list[int], max_tokens: int, stops: tuple[bytes, ...],
                  context: int) -> tuple[Any, ...]:
    engine = ScriptedEngine()
    engine.slot_context = context
    sched = Scheduler(engine, 2, 64, threading.Lock(), make_sampler=lambda r: r,
                      free_sampler=lambda s: None)
    r = request(max_tokens, stops)
    r.script = list(script)  # type: ignore[attr-defined]
    with sched.lock:
        sched.submit(r)
    run_until_idle(sched)
    return r.phase, r.finish, bytes(r.out), r.sampled, r.generated, sched.stats.tokens_out


def through_vllm(script: list[int], max_tokens: int, stops: tuple[bytes, ...],
                 context: int) -> tuple[Any, ...]:
    vocab = HfVocab(Vocab(n_vocab=10, specials=(("<eog>", EOG),), eog=frozenset({EOG}),
                          bos=EOG, add_bos=False, chat_template="",
                          encode=lambda text: [], token_bytes=lambda t: PIECES[t]),
                    context=context)
    outputs = [out([t]) for t in script] + [out([EOG], "stop")]
    run = Running(ScriptedClient(outputs))
    run.runner.vocab = vocab
    try:
        r = request(max_tokens, stops)
        r.buffer = None  # the runner makes its own
        with run.lock:
            run.runner.submit(r)
        run.wait(lambda: r.phase.terminal)
        return (r.phase, r.finish, bytes(r.out), r.sampled, r.generated,
                run.runner.stats.tokens_out)
    finally:
        run.close()


@pytest.mark.parametrize("script,max_tokens,stops,context", [
    ([1, 2, 1], 100, (), 4096),  # to the end of generation
    ([1, 2, 1, 2], 2, (), 4096),  # the length
    ([1, 2, 1], 100, (b"b",), 4096),  # a stop string
    ([1, 6, 2], 100, (b"ST",), 4096),  # a stop string inside a token's bytes
    ([1, 1, 1, 1, 1], 100, (), PROMPT + 3),  # the context's end
    ([4, 5, 1], 100, (), 4096),  # a character split across two tokens
])
def test_both_engines_end_a_stream_alike(script: list[int], max_tokens: int,
                                        stops: tuple[bytes, ...], context: int) -> None:
    llama = through_llama(script, max_tokens, stops, context)
    vllm = through_vllm(script, max_tokens, stops, context)
    assert llama == vllm
    assert llama[0].terminal


def test_an_alternative_the_mask_ruled_out_is_none_on_either_engine() -> None:
    """vLLM masks the logits before its logprobs, so a ruled-out token comes back at -inf
    among the top ones; llama.cpp's logprobs.compute never lists one: neither does vLLM's
    entry now."""
    from types import SimpleNamespace

    from aotx.engine.vllm.runner import entry

    ranked = {5: SimpleNamespace(logprob=-0.1, rank=1),
              6: SimpleNamespace(logprob=float("-inf"), rank=2)}
    assert entry(5, ranked, 2) == (-0.1, [(5, -0.1)])


def test_a_thinking_models_reasoning_tokens_are_those_of_its_think_block() -> None:
    from aotx.engine.accept import THINK_INSIDE, THINK_NONE, THINK_UNDECIDED

    def run(think: int, pieces: list[bytes], tags: tuple[bytes, ...] = (b"<think>", b"</think>")
            ) -> tuple[int, int]:
        r = request()
        r.think, r.think_tags = think, tags
        for i, p in enumerate(pieces):
            accept(r, 7 + i, p, 1 + i, EngineStats(), eog=False, held=6 + i, context=64)
        return r.reasoning_tokens, r.think

    # the model opens the block itself: its tokens to </think>, the tags' included
    assert run(THINK_UNDECIDED, [b"\n<th", b"ink>", b"hm", b"</th", b"ink>", b"Hi", b"!"]) \
        == (5, THINK_NONE)
    # an answer that does not open one has none (the tentative count goes)
    assert run(THINK_UNDECIDED, [b"<", b"b>Hi"]) == (0, THINK_NONE)
    # the prompt opened it: every token to </think>
    assert run(THINK_INSIDE, [b"a", b"b", b"</think>", b"c"]) == (3, THINK_NONE)
    # one token holding all of it
    assert run(THINK_UNDECIDED, [b"<think>x</think>y", b"z"]) == (1, THINK_NONE)
    # cut off while thinking
    assert run(THINK_INSIDE, [b"a", b"b"]) == (2, THINK_INSIDE)
    # gpt-oss: the analysis channel's tokens, to the final channel's markers
    harmony = tuple(t.encode() for t in wire.CHANNEL_TAGS)
    assert run(THINK_UNDECIDED, [b"<|channel|>", b"analysis", b"<|message|>", b"hm",
                                 b"<|start|>", b"assistant", b"<|channel|>", b"final",
                                 b"<|message|>", b"Hi"], harmony) == (9, THINK_NONE)
    assert run(THINK_UNDECIDED, [b"<|channel|>", b"final", b"<|message|>", b"Hi"],
               harmony) == (0, THINK_NONE)
    # or to a tool call's commentary channel (its other closing, as admission gives it)
    calls = (*harmony, wire.CHANNEL_CALL.encode())
    assert run(THINK_UNDECIDED, [b"<|channel|>", b"analysis", b"<|message|>", b"hm",
                                 b"<|start|>", b"assistant", b"<|channel|>", b"comment",
                                 b"ary to=functions.f", b"{}"], calls) == (9, THINK_NONE)
