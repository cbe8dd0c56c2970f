"""Logprobs end to end through the official ``openai`` client (issue 20): ``logprobs`` with
``top_logprobs`` 0..20, non-stream and stream, and the native route's document of the
same request.  Each token's logprob is the log-softmax of the logits its sampler read."""

from __future__ import annotations

import base64
import math
from typing import Any

import httpx
import openai
import pytest

from ..helpers import Service

pytestmark = pytest.mark.e2e

ASK: Any = [{"role": "user", "content": "List three fruits with an emoji for each, like 🍎."}]


def check_tokens(content: Any, k: int, greedy: bool) -> bytes:
    """The checks every token passes; the tokens' bytes joined."""
    joined = b""
    for t in content:
        raw = bytes(t.bytes)
        joined += raw
        if raw.decode("utf-8", errors="replace") == raw.decode("utf-8", errors="ignore"):
            assert t.token == raw.decode("utf-8")  # bytes decode to the token's text
        assert t.logprob <= 0 and math.isfinite(t.logprob)
        assert len(t.top_logprobs) == k
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True) and all(a <= 0 for a in alts)
        assert sum(math.exp(a) for a in alts) <= 1.0 + 1e-4
        if greedy and k:
            # the greedy choice is the likeliest token: the first alternative
            assert t.logprob == pytest.approx(alts[0], abs=1e-5)
            assert bytes(t.top_logprobs[0].bytes) == raw or alts[0] == alts[1]
        elif k and alts[-1] <= t.logprob:  # listed when it is among the k likeliest
            assert any(bytes(a.bytes) == raw and a.logprob == pytest.approx(t.logprob, abs=1e-5)
                       for a in t.top_logprobs)
    return joined


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_non_stream_logprobs_cover_the_content_exactly(oai: openai.OpenAI, k: int) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40,
                                    temperature=0, logprobs=True, top_logprobs=k)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    text = choice.message.content or ""
    assert check_tokens(choice.logprobs.content, k, greedy=True) == text.encode()
    assert len(choice.logprobs.content) <= r.usage.completion_tokens  # type: ignore[union-attr]


def test_sampled_tokens_keep_their_own_logprob(oai: openai.OpenAI) -> None:
    for seed in (1, 2):
        r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=30,
                                        temperature=1.2, seed=seed, logprobs=True,
                                        top_logprobs=5)
        content = r.choices[0].logprobs.content  # type: ignore[union-attr]
        # Sampled at 1.2, a token may be a byte that ends no character (seen on an AMD
        # EPYC with seed 1): the text holds U+FFFD for it, the token its raw byte.
        joined = check_tokens(content, 5, greedy=False)
        assert joined.decode("utf-8", errors="replace") == (r.choices[0].message.content
                                                             or "")


def test_without_logprobs_the_choice_says_null(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("kw", [{"logprobs": True, "top_logprobs": 21},
                                {"logprobs": True, "top_logprobs": -1},
                                {"top_logprobs": 3}])
def test_bad_top_logprobs_is_400(oai: openai.OpenAI, kw: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5,
                                    **kw)


def test_stream_chunks_carry_the_logprobs_of_exactly_their_content(
        oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40,
                                        temperature=0, logprobs=True, top_logprobs=3)
    stream = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         stream=True)
    tokens: list[Any] = []
    text, chunks = "", 0
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        piece = c.delta.content or ""
        if c.logprobs is None:
            assert not piece  # the role chunk and the finish chunk
            continue
        chunks += 1
        assert check_tokens(c.logprobs.content, 3, greedy=True) == piece.encode()
        text += piece
        tokens += c.logprobs.content
    assert chunks > 1 and text == whole.choices[0].message.content
    assert [(t.token, t.logprob) for t in tokens] == [
        (t.token, pytest.approx(t.logprob, abs=1e-5))
        for t in whole.choices[0].logprobs.content]  # type: ignore[union-attr]


def test_a_stop_string_ends_the_logprobs_with_the_content(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=30,
                                       temperature=0)
    words = (full.choices[0].message.content or "").split()
    stop = words[len(words) // 2]
    r = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=30,
                                    temperature=0, stop=[stop], logprobs=True)
    text = (r.choices[0].message.content or "").encode()
    joined = check_tokens(r.choices[0].logprobs.content, 0, greedy=True)  # type: ignore[union-attr]
    # a token that the stop string cut has no entry: the tokens are the content, less at
    # most that token's first bytes
    assert text.startswith(joined) and len(text) - len(joined) < 16


def test_the_native_route_gives_the_same_logprobs_in_windows(service: Service,
                                                             oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40,
                                        temperature=0, logprobs=True, top_logprobs=4)
    auth = {"Authorization": f"Bearer {service.token}"}
    with httpx.Client(base_url=service.url, headers=auth, timeout=60) as http:
        a = http.post("/aotx/v1/requests", json={
            "model": "smollm2", "messages": ASK, "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 4}).json()
        rid = a["id"]
        # during generation or after it: read windows until the request is terminal
        # and the stream is read to its end
        cursor, content = "0", []
        while True:
            doc = http.get(f"/aotx/v1/requests/{rid}/logprobs", params={"cursor": cursor})
            assert doc.status_code == 200, doc.text
            d = doc.json()
            assert d["schema"] == "aotx.logprobs.v1" and d["id"] == rid
            content += d["logprobs"]["content"]
            cursor = d["logprobs"]["next_cursor"]
            if d["state"] == "completed" and cursor == d["logprobs"]["total_bytes"]:
                break
        out = http.get(f"/aotx/v1/requests/{rid}").json()
        # a cursor inside a token's record
        bad = http.get(f"/aotx/v1/requests/{rid}/logprobs", params={"cursor": "1"})
        assert bad.status_code == 409
    output = base64.b64decode(out["output"]["bytes"])
    assert b"".join(bytes(t["bytes"]) for t in content) == output
    at = 0
    for t in content:
        assert t["offset"] == at and len(t["top_logprobs"]) == 4
        assert t["top_logprobs"][0]["token_id"] == t["token_id"] or (
            t["top_logprobs"][0]["logprob"] == t["top_logprobs"][1]["logprob"])
        at += len(t["bytes"])
    assert [(t["token"], t["logprob"]) for t in content] == [
        (t.token, pytest.approx(t.logprob, abs=1e-5))
        for t in whole.choices[0].logprobs.content]  # type: ignore[union-attr]
