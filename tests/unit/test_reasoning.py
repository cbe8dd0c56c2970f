"""A thinking model's output told from its answer (gateway/reasoning.py): whole, and as
a stream in any chunking, alike."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aotx.gateway.reasoning import ThinkStream, split

PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n",
                                   "\n\n", " ", "a", "b c", "<th", "ink>"]), max_size=12)


def streamed(text: str, cuts: list[int], opened: bool) -> tuple[str | None, str]:
    s = ThinkStream(opened)
    got: list[tuple[str, str]] = []
    at = 0
    for c in sorted(cuts):
        got += s.feed(text[at:c])
        at = c
    got += s.feed(text[at:]) + s.end()
    thought = "".join(t for k, t in got if k == "thinking")
    answer = "".join(t for k, t in got if k == "answer")
    return thought, answer


@given(PIECES, st.lists(st.integers(0, 60), max_size=6), st.booleans())
def test_the_stream_tells_them_apart_as_the_whole_does(parts: list[str], cuts: list[int],
                                                       opened: bool) -> None:
    text = "".join(parts)
    cuts = [min(c, len(text)) for c in cuts]
    thought, answer = split(text, opened)
    s_thought, s_answer = streamed(text, cuts, opened)
    assert s_answer == answer
    assert s_thought == (thought or "")


def test_the_shapes() -> None:
    assert split("<think>\nhmm\n</think>\n\nHi", False) == ("hmm", "Hi")
    assert split("hmm</think>Hi", True) == ("hmm", "Hi")
    assert split("Hi <think>", False) == (None, "Hi <think>")
    assert split("  <think>cut off", False) == ("cut off", "")
    assert split("", True) == ("", "")
