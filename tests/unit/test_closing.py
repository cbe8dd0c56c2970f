"""A think block's budget kept by forcing its closing (engine/closing.py), on a byte
vocabulary (token t is the byte t) and on pieces of several bytes."""

from __future__ import annotations

from aotx.engine.closing import Closing

PIECES = [b"", b"<think>", b"hm", b"</think>\n\n{\"answer\": 1", b"ab", b"\xe6\x96", b"\x87"]


def closing(budget: int, opening: bytes = b"", pieces: bool = False) -> Closing:
    if pieces:  # token t is PIECES[t]
        return Closing(b"</think>", budget, lambda data: list(data), PIECES.__getitem__,
                       opening)
    return Closing(b"</think>", budget, lambda data: list(data), lambda t: bytes([t]),
                   opening)


def feed(c: Closing, data: bytes) -> None:
    for t in data:
        c.passed(t)


def forced(c: Closing) -> bytes:
    out = b""
    while (t := c.next) is not None:
        out += bytes([t])
        c.passed(t)
    return out


def test_the_closing_is_forced_once_the_budget_is_spent() -> None:
    c = closing(4)
    feed(c, b"abc")
    assert c.next is None  # a token left
    feed(c, b"d")
    assert forced(c) == b"</think>" and c.left == -1
    feed(c, b"{}")
    assert c.next is None  # closed: the answer is the grammar's


def test_the_budget_counts_from_the_opening() -> None:
    c = closing(3, b"<think>")
    feed(c, b"\n<think>ab")
    assert c.next is None and c.left == 1
    feed(c, b"c")
    assert forced(c) == b"</think>"


def test_a_closing_the_model_began_is_finished() -> None:
    c = closing(6)
    feed(c, b"ab</th")
    assert forced(c) == b"ink>"


def test_a_model_that_closes_it_itself_is_left_alone() -> None:
    c = closing(12)
    feed(c, b"hm</think>")
    assert c.left == -1
    feed(c, b"{" * 20)
    assert c.next is None
    c = closing(3, b"<think>", pieces=True)  # the closing and more in one token
    for t in (1, 2, 3):
        c.passed(t)
    assert c.left == -1 and c.next is None


def test_a_character_left_unfinished_is_finished_first() -> None:
    c = closing(2)
    feed(c, b"a\xc3")  # the first byte of a two-byte character, at the budget's end
    assert c.next is None  # waits: the character is not whole
    feed(c, b"\xa9")
    assert forced(c) == b"</think>" and c.left == -1
    c = closing(1, pieces=True)
    c.passed(5)  # a token that ends inside a three-byte character
    assert c.next is None
    c.passed(6)
    assert c.next is not None


def test_a_token_other_than_the_forced_one_forces_the_closing_again() -> None:
    c = closing(2)
    feed(c, b"ab")
    assert c.next == ord("<")
    c.passed(ord("x"))  # (a sampler that did not keep to the one-hot mask)
    assert c.left == 0 and forced(c) == b"</think>"
    c = closing(2)
    feed(c, b"ab</t")  # three of the closing's bytes forced, then another token
    c.passed(ord("<"))
    assert forced(c) == b"/think>"  # (from the "<" that ends the text now)
    c = closing(2)
    feed(c, b"ab</")
    c.passed(ord("/"))  # "</" then "/": the text ends "<//"; the closing begins again
    assert forced(c) == b"</think>"
