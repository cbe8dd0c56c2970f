"""The client's text view of output bytes (``aotx.client._Text``) and its errors: text read
from any byte cursor, in any emissions, is the output from the first whole character at
or after the cursor; a 429's ``Retry-After`` reaches the exception."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aotx.client import BadRequest, RateLimited, _raise_for, _Text


def boundary(data: bytes, cursor: int) -> int:
    """The first character boundary at or after ``cursor``."""
    while cursor < len(data) and 0x80 <= data[cursor] < 0xC0:
        cursor += 1
    return cursor


@given(st.text(min_size=1), st.data())
def test_text_from_any_cursor_in_any_emissions(text: str, data: st.DataObject) -> None:
    out = text.encode()
    cursor = data.draw(st.integers(0, len(out)))
    cuts = sorted(data.draw(st.lists(st.integers(cursor, len(out)), max_size=6)))
    parts = [out[a:b] for a, b in zip([cursor, *cuts], [*cuts, len(out)], strict=True)]
    dec = _Text(cursor)
    got = "".join(dec.feed(p) for p in parts) + dec.end()
    assert got == out[boundary(out, cursor):].decode()


def test_inside_a_character() -> None:
    out = "汉字".encode()  # 3 bytes each
    for cursor in (1, 2):
        dec = _Text(cursor)
        assert dec.feed(out[cursor:cursor + 1]) == "" and dec.feed(out[cursor + 1:]) == "字"
    assert _Text(0).feed(out) == "汉字"
    with pytest.raises(UnicodeDecodeError):  # from 0 a stray byte is an error, not skipped
        _Text(0).feed(out[1:])


def test_retry_after_reaches_the_exception() -> None:
    error = {"error": {"message": "slow down", "type": "rate_limit_error", "code": None,
                       "param": None}}
    with pytest.raises(RateLimited) as err:
        _raise_for(httpx.Response(429, headers={"Retry-After": "55"}, json=error))
    assert err.value.retry_after == 55.0 and err.value.message == "slow down"
    with pytest.raises(BadRequest) as bad:
        _raise_for(httpx.Response(400, json=error))
    assert bad.value.retry_after is None
