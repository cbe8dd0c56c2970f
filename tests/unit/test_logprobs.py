"""Logprobs (issue 20): the batched log-softmax and top-k, the per-request annotation
stream that carries them (published with the token's bytes, never ahead of them), and its
windows as the device answers READ and WAIT with READ_FLAG_ANNOTATIONS.

A scripted engine stands for llama.cpp (tests/e2e/test_e2e_logprobs.py runs the model).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aotx import wire
from aotx.device.runtime import Device
from aotx.engine.llama.scheduler import OutputBuffer, Request, Scheduler
from aotx.engine.logprobs import MAX_TOP, Annotations, compute, line, window

from .devices import call
from .test_device_protocol import text_submission
from .test_scheduler import VOCAB, make, req, run_until_idle, submit

Pair = tuple[Device, Scheduler]


def lines(data: bytes | bytearray) -> list[dict[str, Any]]:
    assert not data or data.endswith(b"\n")
    return [orjson.loads(x) for x in bytes(data).splitlines()]


# -- compute: log-softmax and top-k of one step's rows, together ------------------------------

@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 64)),
                  elements=st.floats(-30, 30, width=32)),
       st.data())
def test_compute_is_the_log_softmax_and_its_k_likeliest(logits: np.ndarray[Any, Any],
                                                         data: st.DataObject) -> None:
    n, v = logits.shape
    tokens = data.draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    ks = data.draw(st.lists(st.integers(0, MAX_TOP), min_size=n, max_size=n))
    ref = logits.astype(np.float64)
    ref = ref - np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - ref.max(1, keepdims=True)
    for i, (lp, alts) in enumerate(compute(logits, tokens, ks)):
        assert lp == pytest.approx(ref[i, tokens[i]], abs=1e-4)
        assert len(alts) == min(ks[i], v)
        values = [a for _, a in alts]
        assert values == sorted(values, reverse=True) and all(a <= 1e-6 for a in values)
        # the k likeliest: nothing left out scores above the last one listed
        if alts:
            left = np.delete(ref[i], [t for t, _ in alts])
            assert not left.size or left.max() <= values[-1] + 1e-4
        for t, a in alts:
            assert a == pytest.approx(ref[i, t], abs=1e-4)


def test_forbidden_tokens_are_never_listed_and_the_rest_sums_to_one() -> None:
    """A grammar's mask is -inf in the row: those tokens have no probability and are not
    among the alternatives, whatever k asks."""
    row = np.full((1, 8), -np.inf, dtype=np.float32)
    row[0, [2, 5]] = [1.0, 3.0]
    (lp, alts), = compute(row, [5], [20])
    assert [t for t, _ in alts] == [5, 2]
    assert np.exp([a for _, a in alts]).sum() == pytest.approx(1.0)
    assert lp == alts[0][1]


def test_a_line_is_compact_json_of_the_token_and_its_alternatives() -> None:
    entry = (np.float32(-0.25), [(3, np.float32(-0.25)), (0, np.float32(-1.5))])
    body = line(3, entry, {3: b"ab", 0: b""}.__getitem__, b"ab")
    assert body.endswith(b"\n") and body.count(b"\n") == 1
    assert orjson.loads(b'{"offset":7' + body) == {
        "offset": 7, "token": 3, "logprob": -0.25, "bytes": [97, 98],
        "top": [[3, -0.25, [97, 98]], [0, -1.5, []]]}


# -- the annotation stream: a token's line comes with its last byte -------------------------------

def feed(pieces: list[bytes], stops: tuple[bytes, ...] = ()) -> tuple[bytes, Annotations]:
    """Push ``pieces`` through an output buffer as the scheduler does, each with a line."""
    buf, notes, out = OutputBuffer(stops), Annotations(0), bytearray()
    for i, piece in enumerate(pieces):
        notes.next = b',"token":%d}\n' % i
        published, stopped = buf.push(piece)
        out += published
        notes.push(len(piece), len(out))
        # never ahead of the bytes: every line's token is wholly in the output
        assert all(n["offset"] + len(pieces[n["token"]]) <= len(out) for n in lines(notes.data))
        if stopped:
            break
    out += buf.flush()
    notes.end(len(out))
    return bytes(out), notes


def test_a_token_held_back_for_utf8_comes_with_the_token_that_completes_it() -> None:
    out, notes = feed([b"a", b"\xe2", b"\x82\xac", b"b"])
    assert out == "a€b".encode()
    assert [(n["token"], n["offset"]) for n in lines(notes.data)] == [(0, 0), (1, 1), (2, 2),
                                                                      (3, 4)]


def test_a_token_cut_by_a_stop_string_has_no_line() -> None:
    """Stop "cd": the token "bc" is half published (its "c" starts the stop string): it
    gets no line; the token before it does, held back until the stop string was seen."""
    out, notes = feed([b"a", b"bc", b"d", b"e"], stops=(b"cd",))
    assert out == b"ab"
    assert [n["token"] for n in lines(notes.data)] == [0]
    assert not notes.pending


def test_an_incomplete_utf8_tail_dropped_at_the_end_has_no_line() -> None:
    out, notes = feed([b"x", b"\xe2\x82"])
    assert out == b"x" and [n["token"] for n in lines(notes.data)] == [0]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"b", b"STOP", b"\xe2", b"\x82\xac", "é".encode(), b""]),
                max_size=30))
def test_the_lines_tile_a_prefix_of_the_output(pieces: list[bytes]) -> None:
    out, notes = feed(pieces, stops=(b"STOP",))
    at = 0
    for n in lines(notes.data):
        assert n["offset"] == at and out[at:at + len(pieces[n["token"]])] == pieces[n["token"]]
        at += len(pieces[n["token"]])
    assert len(out) - at < 4  # at most a token cut by the stop string or an unfinished one


# -- windows: whole lines at a cursor ------------------------------------------------------------

def test_windows_hold_whole_lines_and_a_cursor_must_start_one() -> None:
    data = b'{"a":1}\n{"b":22}\n{"c":333}\n'
    assert window(data, 0, 12) == b'{"a":1}\n'
    assert window(data, 8, 100) == b'{"b":22}\n{"c":333}\n'
    assert window(data, 8, 3) == b'{"b":22}\n'  # a line longer than the window: all of it
    assert window(data, len(data), 10) == b""
    assert window(data, 3, 10) is None and window(data, len(data) + 1, 10) is None


# -- the scheduler: who asked gets lines, who did not costs nothing ----------------------------------

def asking(name: int, script: list[int], k: int, **kw: Any) -> Request:
    r = req(name, script, **kw)
    r.sampling = wire.Sampling(logprobs=k + 1)
    return r


def test_only_requests_that_ask_get_lines_computed_in_one_call_per_step() -> None:
    sched, engine = make()
    a, b, c = asking(1, [1, 3, 2], 2), asking(2, [2, 2], 0), req(3, [1] * 5)
    for r in (a, b, c):
        submit(sched, r)
    run_until_idle(sched)
    assert c.notes is None and bytes(a.out) == "aéb".encode() and bytes(b.out) == b"bb"
    # one logits_rows call a step, with the rows of the requests that asked only
    assert all(len(rows) <= 2 for rows in engine.rows_read)
    assert sum(len(rows) for rows in engine.rows_read) == 5  # the EOG samples need none
    got = lines(a.notes.data)  # type: ignore[union-attr]
    assert [(n["token"], n["offset"], bytes(n["bytes"])) for n in got] == [
        (1, 0, b"a"), (3, 1, "é".encode()), (2, 3, b"b")]
    scores = -np.arange(VOCAB) / 2
    lse = np.log(np.exp(scores).sum())
    for n in got:
        assert n["logprob"] == pytest.approx(scores[n["token"]] - lse, abs=1e-5)
        assert [t for t, _, _ in n["top"]] == [0, 1]  # the two likeliest, EOG first
        assert n["top"][0][2] == [120] and n["top"][1][2] == [97]  # the pieces x and a
    assert all(n["top"] == [] for n in lines(b.notes.data))  # type: ignore[union-attr]


# -- the device: READ and WAIT with READ_FLAG_ANNOTATIONS ----------------------------------------

def _asked(dev: Device, sched: Scheduler, script: list[int], k: int = 3) -> wire.Header:
    sub = wire.decode_submission(text_submission())
    payload = wire.encode_submission(sub._replace(sampling=wire.Sampling(logprobs=k + 1)))
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1), payload)
    assert ah.status == 202
    dev.state.requests[ah.identity].script = list(script)  # type: ignore[attr-defined]
    return ah


def test_reads_page_through_the_annotation_stream_in_whole_lines(device: Pair) -> None:
    dev, sched = device
    dev.state.limits.window_bytes = 100  # a few lines a window
    ah = _asked(dev, sched, [1, 2, 3, 1, 2, 4, 5, 1] * 3)
    run_until_idle(sched)
    req = dev.state.requests[ah.identity]
    stream = bytes(req.notes.data)  # type: ignore[union-attr]
    read = wire.Header(op=wire.Op.READ, identity=ah.identity, flags=wire.READ_FLAG_ANNOTATIONS)
    cursor, got, windows = 0, b"", 0
    while True:
        h, body = call(dev, read._replace(cursor=cursor))
        assert h.status == 200 and h.total == len(stream) and h.phase == wire.Phase.COMPLETED
        if not body:
            break
        assert body.endswith(b"\n") and len(body) <= 100 + 200
        got, cursor, windows = got + body, cursor + len(body), windows + 1
    assert got == stream and windows > 3
    assert b"".join(bytes(n["bytes"]) for n in lines(got)) == bytes(req.out)
    # the output window is as it was: the flag alone selects the stream
    h, body = call(dev, read._replace(flags=0))
    assert h.total == len(req.out) and body == bytes(req.out)[:100]
    # a cursor inside a line, or past the end, is 409 CURSOR with the stream's total
    for bad in (1, len(stream) + 1):
        h, body = call(dev, read._replace(cursor=bad))
        assert (h.status, h.reason, h.total, body) == (409, wire.Reason.CURSOR, len(stream), b"")
    # the device's allocation counts the stream
    tel = wire.decode_telemetry(call(dev, wire.Header(op=wire.Op.TELEMETRY))[1])
    req.notes = None
    assert wire.decode_telemetry(call(dev, wire.Header(op=wire.Op.TELEMETRY))[1]
                                 ).allocation_bytes == tel.allocation_bytes - len(stream)


def test_a_request_that_did_not_ask_has_an_empty_stream(device: Pair) -> None:
    dev, sched = device
    ah, _ = call(dev, wire.Header.request(wire.Op.SUBMIT, role=1), text_submission())
    dev.state.requests[ah.identity].script = [1, 1]  # type: ignore[attr-defined]
    run_until_idle(sched)
    h, body = call(dev, wire.Header(op=wire.Op.READ, identity=ah.identity,
                                    flags=wire.READ_FLAG_ANNOTATIONS))
    assert (h.status, h.total, body) == (200, 0, b"")


def test_a_wait_on_the_stream_parks_until_a_line_comes(device: Pair) -> None:
    dev, sched = device
    ah = _asked(dev, sched, [1, 4, 5, 1], k=0)
    wait = wire.Header.request(wire.Op.WAIT, principal=7, epoch=dev.epoch, identity=ah.identity,
                               wait_ms=10_000, phase=int(wire.Phase.QUEUED),
                               flags=wire.READ_FLAG_ANNOTATIONS, tag=9)
    with dev.state.lock:
        assert dev.respond(2, wait, b"") is None  # parked: no line yet
    sched.step()  # the prompt, and the first token ("a")
    req = dev.state.requests[ah.identity]
    cursor = len(req.notes.data)  # type: ignore[union-attr]
    assert cursor and bytes(req.out) == b"a"
    with dev.state.lock:
        dev.waits.settle(time.monotonic())
    h, body = wire.decode_packet(dev.region.read(2))
    assert (h.status, h.tag, h.total, len(body)) == (200, 9, cursor, cursor)
    # the next token (b"\xe2") is held back with its bytes: a WAIT at the cursor parks on
    sched.step()
    assert bytes(req.out) == b"a" and len(req.notes.data) == cursor  # type: ignore[union-attr]
    again = wait._replace(cursor=cursor, phase=int(wire.Phase.RUNNING))
    with dev.state.lock:
        assert dev.respond(3, again, b"") is None


def test_read_flag_bits_other_than_annotations_are_refused(device: Pair) -> None:
    dev, _ = device
    for op in (wire.Op.READ, wire.Op.WAIT):
        h, _ = call(dev, wire.Header(op=op, identity=b"x" * 16, flags=2))
        assert (h.status, h.reason, h.detail) == (400, wire.Reason.NONZERO_FIELD, 116)


# -- the gateway's stream: text cut where a token ends on a character boundary -----------------

def _choice(monkeypatch: pytest.MonkeyPatch, toks: list[bytes], tools: Any = None) -> Any:
    """A ChoiceText whose annotation stream holds ``toks``, one line each (its cursor
    counts lines here)."""
    from aotx.gateway import choices

    stream, at = [], 0
    for i, t in enumerate(toks):
        stream.append({"offset": at, "token": i, "logprob": -0.5, "bytes": list(t), "top": []})
        at += len(t)

    async def notes(g: Any, p: Any, epoch: int, identity: bytes, cursor: int
                    ) -> tuple[list[dict[str, Any]], int]:
        return stream[cursor:], len(stream)

    monkeypatch.setattr(choices.calls, "notes", notes)
    return choices.ChoiceText(None, None, wire.Header(), True, tools)  # type: ignore[arg-type]


def test_stream_chunks_hold_exactly_their_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    text = _choice(monkeypatch, [b"a", b"\xe2", b"\x82\xac", b"b", b""])

    def add(data: bytes, final: bool = False) -> list[tuple[str, list[bytes]]]:
        got = asyncio.run(text._pieces(data, final))
        return [(s, [bytes(t["bytes"]) for t in lps]) for s, lps in got]

    assert add(b"a\xe2") == [("a", [b"a"])]  # "\xe2" ends inside a character: held
    assert add(b"\x82") == []
    assert add(b"\xacb") == [("€b", [b"\xe2", b"\x82\xac", b"b", b""])]
    assert add(b"", final=True) == []


def test_tool_streams_send_every_tokens_logprobs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tools, the text before a call streams with its tokens' logprobs; the call's
    tokens are held with the call and go with its first delta."""
    import asyncio

    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    toks = [b"Hi", b".", b"\n", b"<", b"tool", b"_call", b">\n", call[12:].encode()]
    text = _choice(monkeypatch, toks, "auto")
    events = [e for t in toks for e in asyncio.run(text.add(t))]
    events += asyncio.run(text.add(b"", final=True)) + text.end()
    got = [(d, [bytes(x["bytes"]) for x in lps or []], f) for d, lps, f in events]
    assert got[0] == ({"content": "Hi"}, [b"Hi"], None)
    assert got[1] == ({"content": "."}, [b"."], None)
    first_call = next(i for i, (d, _, _) in enumerate(got) if "tool_calls" in d)
    assert got[first_call][1] == toks[2:]  # the newline and the call's tokens
    assert sum(len(lps) for _, lps, _ in got) == len(toks)
    assert got[-1] == ({}, [], "tool_calls")
