"""A thinking model's output told from its answer (gateway/reasoning.py): whole, and as
a stream in any chunking, alike; for the <think> family and gpt-oss's channels."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aotx import wire
from aotx.gateway.reasoning import Think, ThinkStream, mode, split, stream

PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n",
                                   "\n\n", " ", "a", "b c", "<th", "ink>"]), max_size=12)
CHANNELS = st.lists(st.sampled_from([
    "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>",
    "<|channel|>final<|message|>", "<|channel|>", "<|message|>", "<|start|>", "assistant",
    "analysis", "final", "<|", "|>", "\n", " ", "a", "b c",
    "<|start|>assistant<|channel|>commentary", "commentary", " to=functions.f"]), max_size=12)
HARMONY = mode(wire.STATE_FLAG_THINKS | wire.STATE_FLAG_CHANNELS)


def streamed(text: str, cuts: list[int], think: Think) -> tuple[str | None, str]:
    s = ThinkStream(think)
    got: list[tuple[str, str]] = []
    at = 0
    for c in sorted(cuts):
        got += s.feed(text[at:c])
        at = c
    got += s.feed(text[at:]) + s.end()
    thought = "".join(t for k, t in got if k == "thinking")
    answer = "".join(t for k, t in got if k == "answer")
    return thought, answer


def same_both_ways(text: str, cuts: list[int], think: Think) -> None:
    cuts = [min(c, len(text)) for c in cuts]
    thought, answer = think.split(text)
    s_thought, s_answer = streamed(text, cuts, think)
    assert s_answer == answer
    assert s_thought == (thought or "")


@given(PIECES, st.lists(st.integers(0, 60), max_size=6), st.booleans())
def test_the_stream_tells_them_apart_as_the_whole_does(parts: list[str], cuts: list[int],
                                                       opened: bool) -> None:
    same_both_ways("".join(parts), cuts, Think(opened))


@given(CHANNELS, st.lists(st.integers(0, 200), max_size=6))
def test_gpt_oss_channels_alike(parts: list[str], cuts: list[int]) -> None:
    assert HARMONY is not None
    same_both_ways("".join(parts), cuts, HARMONY)


def test_the_shapes() -> None:
    closed, opened = Think(False), Think(True)
    assert closed.split("<think>\nhmm\n</think>\n\nHi") == ("hmm", "Hi")
    assert opened.split("hmm</think>Hi") == ("hmm", "Hi")
    assert closed.split("Hi <think>") == (None, "Hi <think>")
    assert closed.split("  <think>cut off") == ("cut off", "")
    assert opened.split("") == ("", "")
    assert mode(0) is None and mode(wire.STATE_FLAG_THINKS) == closed
    assert split(0, "<think>a</think>b") == (None, "<think>a</think>b") and stream(0) is None
    assert split(wire.STATE_FLAG_THINKS, "<think>a</think>b") == ("a", "b")
    # gpt-oss: the analysis channel, then the final one (llama.cpp renders the markers;
    # <|end|> between them is a control token, rendered as nothing)
    assert HARMONY is not None and not HARMONY.opened
    assert HARMONY.split("<|channel|>analysis<|message|>Think.<|start|>assistant"
                         "<|channel|>final<|message|>Hi") == ("Think.", "Hi")
    assert HARMONY.split("<|channel|>final<|message|>Hi") == (None, "Hi")
    assert HARMONY.split("<|channel|>analysis<|message|>cut") == ("cut", "")
    # a tool call's commentary channel ends the thinking too; the call keeps its header
    call = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    assert HARMONY.split("<|channel|>analysis<|message|>Think.<|start|>assistant" + call
                         ) == ("Think.", call)
    assert streamed("<|channel|>analysis<|message|>Think.<|start|>assistant" + call,
                    [20, 40, 45, 60], HARMONY) == ("Think.", call)
