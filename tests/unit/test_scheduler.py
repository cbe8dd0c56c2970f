"""The scheduler: continuous batching, cancellation by identity, stop strings, UTF-8.

A scripted engine (one layer, no model) stands for llama.cpp; tests/e2e/test_engine_batching.py
drives the real model.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from aotx.engine.interface import BatchEntry
from aotx.engine.llama.scheduler import Failure, Request, Scheduler
from aotx.engine.output import OutputBuffer, utf8_complete_length
from aotx.wire import Finish, Phase

EOG = 0
VOCAB = 10


class ScriptedEngine:
    """Each sequence emits the tokens scripted for its request, then EOG."""

    slot_context = 4096
    kv_cells = 1 << 20

    def __init__(self) -> None:
        self.steps: list[list[BatchEntry]] = []
        self.seq_script: dict[int, list[int]] = {}
        self.cleared: list[int] = []
        self.trims: list[tuple[int, int]] = []
        self.media: list[tuple[int, int, int, object]] = []  # (seq, pos, n, embeddings)
        self.copies: list[tuple[int, int]] = []
        self.saved: list[int] = []  # save_sequence's calls
        self.restored: list[tuple[int, bytearray]] = []  # restore_sequence's calls
        self.media_status = 0
        self.trim_fails = False  # a memory that cannot be cut back (recurrent models)
        self.restore_fails = False  # llama_state_seq_set_data refuses (a full pool)
        self.rows_read: list[list[int]] = []  # logits_rows' calls (logprobs)

    def thread_figures(self) -> tuple[int, int]:
        return 1, 0

    def decode(self, entries: list[BatchEntry]) -> int:
        self.steps.append(list(entries))
        return 0

    def sample(self, sampler: object, index: int) -> int:
        req = sampler  # the factory below hands the request itself over as the "sampler"
        assert isinstance(req, Request)
        script = req.script  # type: ignore[attr-defined]
        return script.pop(0) if script else EOG

    def logits_rows(self, indices: list[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Logits for a 10-token vocabulary, the same every step: token t scores -t / 2
        (token 0, EOG, the likeliest)."""
        self.rows_read.append(list(indices))
        return np.tile(-np.arange(VOCAB, dtype=np.float32) / 2, (len(indices), 1))

    def piece(self, token: int) -> bytes:
        return {1: b"a", 2: b"b", 3: "é".encode(), 4: b"\xe2", 5: b"\x82\xac", 6: b"STOP"}.get(
            token, b"x")

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def clear_sequence(self, seq: int) -> None:
        self.cleared.append(seq)

    def trim_sequence(self, seq: int, keep: int) -> bool:
        self.trims.append((seq, keep))
        return not self.trim_fails

    def copy_sequence(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))

    def save_sequence(self, seq: int) -> bytearray:
        self.saved.append(seq)
        return bytearray(b"kv%d-" % seq * 100)

    def restore_sequence(self, seq: int, data: bytearray) -> bool:
        self.restored.append((seq, data))
        return not self.restore_fails

    def decode_embeddings(self, embd: object, n_tokens: int, pos: int, seq: int,
                          non_causal: bool = False) -> int:
        self.steps.append([])  # a step of its own: embeddings never share a token batch
        self.media.append((seq, pos, n_tokens, embd))
        return self.media_status


def make(slots: int = 4, batch: int = 64, prompts_per_step: int = 1,
         spill_bytes: int = 0, apart_rows: int = 0) -> tuple[Scheduler, ScriptedEngine]:
    """A scheduler on the scripted engine; ``prompts_per_step=0`` starts every request
    that has a sequence at once (prompts evaluated together)."""
    engine = ScriptedEngine()
    sched = Scheduler(engine, slots, batch, threading.Lock(), make_sampler=lambda r: r,
                      free_sampler=lambda s: None, encode=lambda seg: f"embd{seg.start}",
                      prompts_per_step=prompts_per_step, spill_bytes=spill_bytes,
                      apart_rows=apart_rows)
    return sched, engine


def req(name: int, script: list[int], prompt_len: int = 5, max_tokens: int = 100,
        stops: tuple[bytes, ...] = ()) -> Request:
    r = Request(identity=bytes([name]) * 16, principal=1, revision=1, role=1,
                prompt=list(range(100, 100 + prompt_len)), max_tokens=max_tokens, stops=stops)
    r.script = list(script)  # type: ignore[attr-defined]
    return r


def submit(sched: Scheduler, r: Request) -> None:
    with sched.lock:
        sched.submit(r)


def run_until_idle(sched: Scheduler, limit: int = 1000) -> int:
    n = 0
    while sched.step():
        n += 1
        assert n < limit
    return n


def test_requests_share_decode_steps() -> None:
    sched, engine = make(prompts_per_step=0)
    reqs = [req(i, [1] * 10) for i in range(1, 5)]
    for r in reqs:
        submit(sched, r)
    steps = run_until_idle(sched)
    # One prefill step for all four prompts, then 10 shared decode steps (the
    # tenth sample is EOG).  Alone they would need 4 x 11 = 44 steps.
    assert steps == 11
    assert sum(r.sampled for r in reqs) == 44
    assert all(r.phase is Phase.COMPLETED and r.finish is Finish.STOP for r in reqs)
    assert all(bytes(r.out) == b"a" * 10 for r in reqs)
    decode_steps = engine.steps[1:]
    assert all(len({e.seq for e in s}) == 4 for s in decode_steps[:9])
    assert len({e.seq for s in engine.steps for e in s}) == 4


def test_new_requests_join_between_steps() -> None:
    sched, engine = make()
    a = req(1, [1] * 20)
    submit(sched, a)
    for _ in range(5):
        sched.step()
    b = req(2, [2] * 3)
    submit(sched, b)
    sched.step()  # b's prompt is prefilled in the same step as a's next token
    last = engine.steps[-1]
    assert {e.seq for e in last} == {a.seq, b.seq}
    assert sum(1 for e in last if e.seq == b.seq) == 5
    run_until_idle(sched)
    assert bytes(a.out) == b"a" * 20 and bytes(b.out) == b"b" * 3


def test_apart_prompt_chunks_and_running_tokens_take_turns() -> None:
    # Without flash attention (apart_rows = 2): a long prompt (three chunks of a 16-token
    # batch) beside a running sequence; no step holds both, and the two kinds alternate,
    # so neither waits more than a step.
    sched, engine = make(batch=16, apart_rows=2)
    a, b = req(1, [1] * 30), req(2, [2] * 3, prompt_len=40)
    submit(sched, a)
    sched.step()  # a's prompt: the running sequences' turn next
    submit(sched, b)
    sa, before = a.seq, len(engine.steps)
    run_until_idle(sched)
    kinds = ["decode" if {e.seq for e in s} == {sa} else "both" if len(s) == 2 else "prompt"
             for s in engine.steps[before:]]
    assert kinds[:7] == ["decode", "prompt", "decode", "prompt", "decode", "prompt", "both"]
    assert [len(s) for s in engine.steps[before + 1:before + 6:2]] == [16, 16, 8]
    assert bytes(a.out) == b"a" * 30 and bytes(b.out) == b"b" * 3


def test_apart_a_final_chunk_is_never_one_row() -> None:
    # An identical prompt, cached but for its last token: that token is evaluated with
    # the one before it (llama.cpp computes a row alone otherwise than among others).
    sched, engine = make(slots=1, apart_rows=2)
    a = req(1, [1, 1], prompt_len=40)
    submit(sched, a)
    run_until_idle(sched)
    b = req(2, [2])
    b.prompt = list(a.prompt)
    submit(sched, b)
    sched.step()
    assert b.reused_tokens == 39 and [e.pos for e in engine.steps[-1]] == [38, 39]
    assert engine.trims[-1] == (b.seq, 38)
    run_until_idle(sched)
    assert bytes(b.out) == b"b"
    # a router reads hits / queries: every prompt token is looked up, 39 of 80 found
    # (engine_metrics' prefix_cache_queries and prefix_cache_hits)
    assert (sched.prompt_tokens_looked_up, sched.reused_tokens) == (80, 39)


def test_apart_a_final_chunk_has_the_builds_tile_rows() -> None:
    # A build whose flash attention tiles from 8 rows (apart_rows = 8, aotx's before it
    # tiled every chunk): a prompt cached but for its last three tokens evaluates them
    # with the five before, so that all eight are tiled as the same prompt's rows are
    # when it is evaluated afresh.
    sched, engine = make(slots=1, apart_rows=8)
    a = req(1, [1, 1], prompt_len=40)
    submit(sched, a)
    run_until_idle(sched)
    b = req(2, [2], prompt_len=40)
    b.prompt = list(a.prompt[:37]) + [7, 7, 7]
    submit(sched, b)
    sched.step()
    assert b.reused_tokens == 37 and [e.pos for e in engine.steps[-1]] == list(range(32, 40))
    assert engine.trims[-1] == (b.seq, 32)


def test_apart_one_prompt_a_step_even_when_all_start_at_once() -> None:
    # prompts_per_step = 0 starts every request, but with apart_rows a step still holds
    # one prompt's chunk: llama.cpp would cut two prompts into equal rows per stream.
    sched, engine = make(slots=4, prompts_per_step=0, apart_rows=8)
    rs = [req(i, [i] * 2, prompt_len=20 + i) for i in range(1, 4)]
    for r in rs:
        submit(sched, r)
    run_until_idle(sched)
    assert all(len({e.seq for e in step}) == 1 for step in engine.steps
               if any(not e.logits for e in step))
    assert [bytes(r.out) for r in rs] == [b"aa", b"bb", "éé".encode()]


def test_a_background_final_chunk_is_widened_to_the_tile_rows_too() -> None:
    # Policy work goes 16 tokens a step: 35 are 16, 16 and a last 3, which takes the 5
    # before it (a 65-row widening, the upstream build's, is not for background work).
    sched, engine = make(slots=1, apart_rows=8)
    b = req(2, [2], prompt_len=35)
    b.background = True
    submit(sched, b)
    run_until_idle(sched)
    prompt_steps = [[e.pos for e in step] for step in engine.steps if len(step) > 1]
    assert prompt_steps == [list(range(0, 16)), list(range(16, 32)), list(range(27, 35))]


def test_queue_waits_for_a_free_sequence() -> None:
    sched, _ = make(slots=2, prompts_per_step=0)
    rs = [req(i, [1] * 3) for i in range(1, 6)]
    for r in rs:
        submit(sched, r)
    sched.step()
    assert [r.phase for r in rs].count(Phase.QUEUED) == 3
    run_until_idle(sched)
    assert all(r.phase is Phase.COMPLETED for r in rs)


def test_cancellation_is_by_identity_and_never_touches_a_later_slot_user() -> None:
    sched, engine = make(slots=1)
    a = req(1, [1] * 50)
    submit(sched, a)
    sched.step()
    sched.step()
    slot = a.seq
    with sched.lock:
        sched.cancel(a)
    assert a.cancel_requested and a.phase is Phase.RUNNING  # requested, not yet confirmed
    sched.step()
    assert a.phase is Phase.CANCELLED and a.seq == -1
    b = req(2, [2] * 5)
    submit(sched, b)
    sched.step()
    assert b.seq == slot  # b reuses a's sequence (and the 4 shared prompt tokens)...
    assert engine.trims[-1] == (slot, 4) and b.reused_tokens == 4
    with sched.lock:
        sched.cancel(a)  # ...and a late cancel of a (by a's identity) does nothing to b
    run_until_idle(sched)
    assert b.phase is Phase.COMPLETED and not b.cancel_requested and bytes(b.out) == b"b" * 5


def test_prompt_prefix_is_reused_from_a_finished_sequence() -> None:
    sched, engine = make(slots=2)
    a = req(1, [1, 1], prompt_len=40)
    submit(sched, a)
    run_until_idle(sched)
    b = req(2, [2, 2], prompt_len=40)
    b.prompt = a.prompt[:30] + [7] * 12  # shares 30 tokens with a's prompt
    submit(sched, b)
    sched.step()
    assert b.seq == a_seq(engine, a) and b.reused_tokens == 30
    assert [e.pos for e in engine.steps[-1]] == list(range(30, 42))  # only the new suffix
    run_until_idle(sched)
    c = req(3, [1])
    c.prompt = list(b.prompt)  # identical prompt: all but the last token reused
    submit(sched, c)
    sched.step()
    assert c.reused_tokens == 41 and len(engine.steps[-1]) == 1
    assert sched.reused_tokens == 71


def test_a_memory_that_cannot_be_trimmed_evaluates_the_whole_prompt() -> None:
    """Where the memory refuses to cut a sequence back (llama.cpp's recurrent and
    hybrid memories refuse a partial removal), the sequence is cleared and the whole
    prompt is evaluated from position 0, instead of decoding after stale cells."""
    sched, engine = make(slots=1)
    a = req(1, [1, 1], prompt_len=40)
    submit(sched, a)
    run_until_idle(sched)
    engine.trim_fails = True
    b = req(2, [2, 2], prompt_len=40)
    b.prompt = a.prompt[:30] + [7] * 12
    submit(sched, b)
    sched.step()
    assert b.reused_tokens == 0 and b.seq in engine.cleared
    assert [e.pos for e in engine.steps[-1]] == list(range(42))
    run_until_idle(sched)
    assert b.phase is Phase.COMPLETED and bytes(b.out) == b"bb"
    assert sched.reused_tokens == 0


def a_seq(engine: ScriptedEngine, r: Request) -> int:
    return engine.steps[0][0].seq


def test_completed_stays_completed_after_cancel() -> None:
    sched, _ = make()
    a = req(1, [1, 1])
    submit(sched, a)
    run_until_idle(sched)
    with sched.lock:
        sched.cancel(a)
    assert a.phase is Phase.COMPLETED and not a.cancel_requested


def test_cancel_while_queued() -> None:
    sched, _ = make(slots=1)
    a, b = req(1, [1] * 10), req(2, [1] * 10)
    submit(sched, a)
    submit(sched, b)
    sched.step()
    with sched.lock:
        sched.cancel(b)
    run_until_idle(sched)
    assert b.phase is Phase.CANCELLED and b.sampled == 0 and a.phase is Phase.COMPLETED


def test_max_tokens_gives_length() -> None:
    sched, _ = make()
    a = req(1, [1] * 50, max_tokens=7)
    submit(sched, a)
    run_until_idle(sched)
    assert a.finish is Finish.LENGTH and a.sampled == 7 and bytes(a.out) == b"a" * 7


def test_stop_string_ends_output_before_it() -> None:
    sched, _ = make()
    a = req(1, [1, 2, 6, 1, 1], stops=(b"bST",))
    submit(sched, a)
    run_until_idle(sched)
    assert a.finish is Finish.STOP and bytes(a.out) == b"a"


def test_chunked_prefill_never_stalls_running_streams() -> None:
    sched, engine = make(batch=64)
    a = req(1, [1] * 30)
    submit(sched, a)
    sched.step()
    sched.step()
    long = req(2, [1] * 3, prompt_len=300)
    submit(sched, long)
    for _ in range(6):
        sched.step()
        step = engine.steps[-1]
        assert len(step) <= 64
        assert any(e.seq == a.seq for e in step)  # a decodes in every step
    assert long.phase is Phase.RUNNING  # 300 prompt tokens in chunks of <= 63
    run_until_idle(sched)
    assert bytes(long.out) == b"aaa"


def test_utf8_is_held_until_complete() -> None:
    sched, _ = make()
    a = req(1, [4, 5, 3], max_tokens=2)  # "\xe2" then "\x82\xac" (the euro sign), then length
    submit(sched, a)
    sched.step()  # prefill, then the first sample: the lone lead byte
    assert a.sampled == 1 and bytes(a.out) == b""  # held back
    run_until_idle(sched)
    assert bytes(a.out) == "€".encode()


def test_incomplete_utf8_tail_is_dropped_at_the_end() -> None:
    sched, _ = make()
    a = req(1, [1, 4], max_tokens=2)
    submit(sched, a)
    run_until_idle(sched)
    assert bytes(a.out) == b"a"
    bytes(a.out).decode("utf-8")


@given(st.text(max_size=30), st.integers(0, 12))
def test_utf8_complete_length(text: str, cut: int) -> None:
    data = text.encode()
    part = data[:cut]
    n = utf8_complete_length(part)
    part[:n].decode("utf-8")  # always decodable
    assert len(part) - n <= 3
    assert utf8_complete_length(data) == len(data)


@given(st.text(alphabet="abcST€", max_size=40), st.lists(st.integers(1, 5), max_size=40),
       st.sampled_from([b"ST", b"\xe2\x82\xac", b"cab"]))
def test_output_buffer_equals_cut_at_first_stop(text: str, cuts: list[int], stop: bytes) -> None:
    data = text.encode()
    buf = OutputBuffer((stop,))
    out = b""
    pos = 0
    stopped = False
    for c in cuts + [len(data)]:
        piece, pos = data[pos:pos + c], pos + c
        got, stopped = buf.push(piece)
        out += got
        if stopped or pos >= len(data):
            break
    if not stopped:
        out += buf.flush()
    k = data.find(stop)
    expected = data[:k] if k >= 0 else data
    if k >= 0 and pos < k + len(stop):
        expected = data[:pos]  # stopped consuming before the stop was complete
        expected = expected[:utf8_complete_length(expected)]
    assert out == expected


def _held_back_reference(held: bytes, stops: tuple[bytes, ...]) -> int:
    """The longest tail of ``held`` that is a proper prefix of a stop (plainly)."""
    keep = 0
    for s in stops:
        for j in range(min(len(s) - 1, len(held)), 0, -1):
            if held.endswith(s[:j]):
                keep = max(keep, j)
                break
    return keep


@given(st.text(alphabet="ab", max_size=60), st.lists(st.integers(1, 4), max_size=40),
       st.lists(st.text(alphabet="ab", min_size=1, max_size=7), min_size=1, max_size=3))
def test_output_buffer_holds_back_exactly_a_possible_stop_start(
        text: str, cuts: list[int], stops: list[str]) -> None:
    """After every piece, what stays held is exactly the longest tail that could still
    begin a stop string (ASCII here, so UTF-8 holds nothing back)."""
    data, stop_bytes = text.encode(), tuple(s.encode() for s in stops)
    buf, pos, seen = OutputBuffer(stop_bytes), 0, b""
    for c in cuts + [len(data)]:
        piece, pos = data[pos:pos + c], pos + c
        seen += piece
        _, stopped = buf.push(piece)
        if stopped or pos >= len(data):
            break
        assert bytes(buf.held) == seen[len(seen) - _held_back_reference(seen, stop_bytes):]


def media_req(name: int, script: list[int], layout: list[int | str]) -> Request:
    """A request whose prompt is text tokens and media spans ("3" = an image of 3 positions)."""
    from aotx.engine.multimodal import MediaSegment

    r = req(name, script)
    r.prompt, r.segments = [], []
    for part in layout:
        if isinstance(part, str):
            r.segments.append(MediaSegment(start=len(r.prompt), n_tokens=int(part), kind="image"))
            r.prompt += [-(1000 * name + len(r.segments))] * int(part)
        else:
            r.prompt.append(part)
    return r


def test_media_segments_decode_in_steps_of_their_own_between_prompt_chunks() -> None:
    sched, engine = make(slots=2, batch=64)
    talker = req(1, [1, 1, 1, 1, 1, 1])
    submit(sched, talker)
    sched.step()  # the talker's prompt; it is running from now on
    looker = media_req(2, [2, 2], [100, 101, "3", 102, 103])
    submit(sched, looker)
    for _ in range(4):
        sched.step()
    # step 2: the talker's token and the looker's text up to the image (not into it)
    assert [(e.seq, e.pos) for e in engine.steps[1]] == [(0, 5), (1, 0), (1, 1)]
    # step 3: the image alone as embeddings at positions 2..4, then the talker's token
    assert engine.media == [(1, 2, 3, "embd2")]
    assert engine.steps[2] == [] and [(e.seq, e.pos) for e in engine.steps[3]] == [(0, 6)]
    # step 4: the text after the image, with logits on the prompt's last position only
    assert [(e.seq, e.pos, e.token, e.logits) for e in engine.steps[4] if e.seq == 1] == [
        (1, 5, 102, False), (1, 6, 103, True)]
    run_until_idle(sched)
    assert bytes(looker.out) == b"bb" and looker.phase is Phase.COMPLETED
    assert sched.media_decoded == 1 and looker.n_past == 7 + 2


def test_a_failed_media_decode_fails_only_its_request() -> None:
    sched, engine = make(slots=2)
    ok = req(1, [1, 1])
    bad = media_req(2, [2], ["2", 100])
    engine.media_status = 1  # the KV cache had no room for the embeddings
    submit(sched, ok)
    submit(sched, bad)
    run_until_idle(sched)
    assert bad.phase is Phase.FAILED and bad.failure is Failure.NO_MEMORY  # the device: 503
    assert ok.phase is Phase.COMPLETED and bytes(ok.out) == b"aa"
    assert 1 in engine.cleared  # the failed sequence's cells are dropped


def test_a_cached_image_prefix_never_matches_another_image() -> None:
    sched, engine = make(slots=1)
    first = media_req(1, [1], [100, 101, "2", 102])
    submit(sched, first)
    run_until_idle(sched)
    second = media_req(2, [1], [100, 101, "2", 102])  # same text, another image
    submit(sched, second)
    run_until_idle(sched)
    assert second.reused_tokens == 2  # the text before the image, not the image
    assert engine.media[-1][:3] == (0, 2, 2)


def test_a_new_request_copies_a_shared_prefix_from_a_running_sequence() -> None:
    sched, engine = make(slots=3, batch=64)
    shared = list(range(500, 530))  # 30 tokens every prompt starts with
    first = req(1, [1] * 10)
    first.prompt = [*shared, 7, 8]
    submit(sched, first)
    sched.step()  # first's whole prompt is in sequence 0
    second = req(2, [2])
    second.prompt = [*shared, 9]
    short = req(3, [2])
    short.prompt = [*shared[:10], 4]  # shares 10 tokens: below COPY_MIN_TOKENS
    submit(sched, second)
    submit(sched, short)
    sched.step()
    assert engine.copies == [(0, 1)]
    assert (1, 30) in engine.trims and second.reused_tokens == 30
    # only the token after the shared prefix was evaluated for the second request
    assert [e.pos for e in engine.steps[1] if e.seq == 1] == [30]
    assert short.reused_tokens == 0 and sched.copies == 1
    run_until_idle(sched)


def test_warm_puts_the_template_prefix_in_sequence_zero() -> None:
    sched, engine = make(slots=2, batch=8)
    sched.warm(list(range(500, 520)))
    assert [len(s) for s in engine.steps] == [8, 8, 4]  # in batch-sized pieces
    assert not any(e.logits for s in engine.steps for e in s)
    r = req(1, [1])
    r.prompt = [*range(500, 520), 7]
    submit(sched, r)
    sched.step()
    assert r.seq == 0 and r.reused_tokens == 20


# -- fair sharing between principals (engine/fair.py) ------------------------------------------
def of(principal: int, r: Request) -> Request:
    r.principal = principal
    return r


def test_a_principal_with_nothing_running_takes_the_next_free_slot() -> None:
    sched, _ = make(slots=2, prompts_per_step=0)
    flood = [of(1, req(i, [1] * (3 + i))) for i in range(1, 31)]  # 30 queued by principal 1
    for r in flood:
        submit(sched, r)
    sched.step()  # two of principal 1's requests run, 28 wait
    late = of(2, req(99, [2]))
    submit(sched, late)
    while late.phase is Phase.QUEUED:
        assert sched.step()
    # the first slot that freed went to principal 2, ahead of principal 1's 28
    assert sum(1 for r in flood if r.phase is Phase.COMPLETED) >= 1
    assert sum(1 for r in flood if r.phase is not Phase.QUEUED) == 2
    run_until_idle(sched, limit=5000)
    assert late.phase is Phase.COMPLETED


def test_principals_with_queued_requests_take_turns() -> None:
    sched, _ = make(slots=1)
    a = [of(1, req(i, [1])) for i in range(1, 5)]
    b = [of(2, req(i, [1])) for i in range(11, 15)]
    for r in [*a, *b]:  # principal 1 queued all of its requests first
        submit(sched, r)
    run_until_idle(sched)
    order = sorted([*a, *b], key=lambda r: r.first_token_ns)
    assert [r.principal for r in order] == [1, 2] * 4


def test_another_principals_cached_prompt_is_evaluated_again() -> None:
    sched, engine = make(slots=1)
    public = list(range(500, 510))
    sched.warm(public)
    mine = of(1, req(1, [1]))
    mine.prompt = [*public, *range(600, 640)]  # the template's start, then private text
    submit(sched, mine)
    run_until_idle(sched)
    theirs = of(2, req(2, [1]))
    theirs.prompt = list(mine.prompt)  # the same text from someone else
    submit(sched, theirs)
    sched.step()
    assert theirs.reused_tokens == len(public)  # only the public prefix is reused
    run_until_idle(sched)
    again = of(1, req(3, [1]))
    again.prompt = list(mine.prompt)
    submit(sched, again)
    sched.step()
    # principal 2's run left its own cells: principal 1 now reuses only the public prefix
    assert again.reused_tokens == len(public)
    run_until_idle(sched)
    once_more = of(1, req(4, [1]))
    once_more.prompt = list(mine.prompt)
    submit(sched, once_more)
    sched.step()
    assert once_more.reused_tokens == len(mine.prompt) - 1  # its own cells: all but the last


PUBLIC = list(range(500, 510))


def private_then_other(sched: Scheduler) -> tuple[Request, Request]:
    """Principal 1's 110 tokens (the public prefix first) end in sequence 0; principal
    2's request, which shares only the public prefix, has then started."""
    sched.warm(PUBLIC)
    mine = of(1, req(1, [1]))
    mine.prompt = [*PUBLIC, *range(600, 700)]
    submit(sched, mine)
    run_until_idle(sched)
    theirs = of(2, req(2, [1]))
    theirs.prompt = [*PUBLIC, *range(800, 850)]
    submit(sched, theirs)
    sched.step()
    return mine, theirs


def test_another_principal_takes_an_empty_sequence_over_ones_private_cells() -> None:
    sched, _ = make(slots=2)
    mine, theirs = private_then_other(sched)
    assert theirs.seq == 1  # not sequence 0, where principal 1's 110 tokens are kept
    run_until_idle(sched)
    again = of(1, req(3, [1]))
    again.prompt = list(mine.prompt)
    submit(sched, again)
    sched.step()
    assert again.reused_tokens == len(mine.prompt) - 1


def test_a_running_sequence_is_copied_only_within_a_principal() -> None:
    sched, engine = make(slots=3, prompts_per_step=0)
    shared = list(range(500, 540))
    first = of(1, req(1, [1] * 10))
    first.prompt = [*shared, 7]
    submit(sched, first)
    sched.step()
    other = of(2, req(2, [2]))
    other.prompt = [*shared, 9]
    same = of(1, req(3, [2]))
    same.prompt = [*shared, 8]
    submit(sched, other)
    submit(sched, same)
    sched.step()
    assert other.reused_tokens == 0 and same.reused_tokens == 40
    assert len(engine.copies) == 1
    run_until_idle(sched)


def test_prompts_are_evaluated_one_request_at_a_time_in_admission_order() -> None:
    """The default: a request starts when no other is evaluating its prompt, so the
    first to arrive samples its first token after its own prompt only, and each later
    one after the prompts before it; every request still finishes, the running ones
    decoding meanwhile."""
    sched, engine = make(slots=4)
    reqs = [req(i, [1] * 3, prompt_len=8) for i in range(1, 5)]
    for r in reqs:
        submit(sched, r)
    first: dict[int, int] = {}  # request -> the step of its first sample
    seqs: dict[int, int] = {}
    step = 0
    while sched.step():
        step += 1
        for r in reqs:
            if r.sampled and r.identity[0] not in first:
                first[r.identity[0]], seqs[r.identity[0]] = step, r.seq
    # each of the first 4 steps evaluates one request's prompt, beside the running tokens
    assert [sorted({e.seq for e in s if not e.logits}) for s in engine.steps[:4]] \
        == [[seqs[1]], [seqs[2]], [seqs[3]], [seqs[4]]]
    assert [len(s) for s in engine.steps[:4]] == [8, 9, 10, 11]
    assert first == {1: 1, 2: 2, 3: 3, 4: 4}
    assert all(r.phase is Phase.COMPLETED and bytes(r.out) == b"aaa" for r in reqs)


def test_a_request_that_waits_to_start_copies_the_prefix_evaluated_before_it() -> None:
    """Users arriving together with one system prompt: the first evaluates it; the next
    of the same principal starts after and copies it, evaluating only its own tokens;
    another principal's request evaluates the whole prompt (no cross-principal reuse)."""
    sched, engine = make(slots=3, batch=128)
    shared = list(range(500, 540))
    first, same, other = of(1, req(1, [1] * 10)), of(1, req(2, [2])), of(2, req(3, [2]))
    for r, last in ((first, 7), (same, 8), (other, 9)):
        r.prompt = [*shared, last]
        submit(sched, r)
    run_until_idle(sched)
    assert first.reused_tokens == 0 and same.reused_tokens == 40 and other.reused_tokens == 0
    assert sched.stats.prompt_tokens_in == 41 + 1 + 41
    assert len(engine.copies) == 1


def test_the_same_prompt_sent_together_is_evaluated_once() -> None:
    """n choices (or one prompt sent several times at once) by one principal: the first
    evaluates the prompt, the others wait for it and copy its cells, then evaluate only
    the last prompt token each.  Another principal's same prompt is evaluated anew."""
    sched, engine = make(slots=4, batch=128, prompts_per_step=0)
    prompt = list(range(500, 540))
    twins = [of(1, req(i, [1, 1])) for i in range(1, 4)]
    stranger = of(2, req(9, [1, 1]))
    for r in [*twins, stranger]:
        r.prompt = list(prompt)
        submit(sched, r)
    sched.step()  # the first twin and the stranger evaluate 40 tokens each
    assert [sum(1 for e in engine.steps[0] if e.seq == r.seq) for r in (twins[0], stranger)] \
        == [40, 40]
    assert twins[1].phase is Phase.QUEUED and twins[2].phase is Phase.QUEUED
    sched.step()  # the twins copy the first one's sequence: one token each
    assert len(engine.copies) == 2 and all(t.reused_tokens == 39 for t in twins[1:])
    run_until_idle(sched)
    assert all(r.phase is Phase.COMPLETED for r in [*twins, stranger])
    assert sched.stats.prompt_tokens_in == 40 + 40 + 1 + 1


class PoolEngine(ScriptedEngine):
    """A KV pool of ``kv_cells`` cells, counted as llama.cpp's unified cache would hold
    them: a decode that does not fit returns 1 and changes nothing."""

    def __init__(self, cells: int) -> None:
        super().__init__()
        self.kv_cells = cells
        self.held: dict[int, int] = {}  # seq -> cells (positions 0..n-1)

    def decode(self, entries: list[BatchEntry]) -> int:
        if sum(self.held.values()) + len(entries) > self.kv_cells:
            self.steps.append([])
            return 1
        for e in entries:
            assert e.pos == self.held.get(e.seq, 0), "positions follow the sequence's cells"
            self.held[e.seq] = e.pos + 1
        return super().decode(entries)

    def clear_sequence(self, seq: int) -> None:
        self.held[seq] = 0
        super().clear_sequence(seq)

    def trim_sequence(self, seq: int, keep: int) -> bool:
        self.held[seq] = min(self.held.get(seq, 0), keep)
        return super().trim_sequence(seq, keep)


def test_a_pool_too_small_for_all_preempts_and_every_request_completes_the_same(
        monkeypatch: Any) -> None:
    """Three requests that need 60 cells in a pool of 40: the last admitted gives its
    cells back when a decode finds none, evaluates its prompt and its tokens again later,
    and every request writes the bytes it writes without pressure."""
    from aotx.engine.llama import kvpool
    monkeypatch.setattr(kvpool, "GROWTH", 1)  # admit up to the brim: the decodes overflow
    scripts = [[1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2], [2] * 14, [1, 1, 2] * 4 + [1, 1]]
    outputs = []
    for cells in (1 << 20, 40):
        engine = PoolEngine(cells)
        sched = Scheduler(engine, 4, 64, threading.Lock(), make_sampler=lambda r: r,
                          free_sampler=lambda s: None)
        reqs = [req(i + 1, script) for i, script in enumerate(scripts)]
        for r in reqs:
            submit(sched, r)
        run_until_idle(sched)
        assert all(r.phase is Phase.COMPLETED and r.finish is Finish.STOP for r in reqs)
        outputs.append([bytes(r.out) for r in reqs])
        if cells == 40:
            assert sched.pool.preemptions >= 1 and any(r.preemptions for r in reqs)
            assert [] in engine.steps  # a decode found no cells: one request gave them back
    assert outputs[0] == outputs[1]
    assert [r.prompt_tokens for r in reqs] == [5, 5, 5]  # usage counts the prompt once


def test_a_new_request_waits_for_cells_and_cached_prefixes_are_given_back() -> None:
    """With room for one running request and its growth, the second waits in the queue
    (no preemption); a finished request's cached prefix is evicted for a newcomer."""
    engine = PoolEngine(2 * kvpool_growth() + 8)
    sched = Scheduler(engine, 4, 64, threading.Lock(), make_sampler=lambda r: r,
                      free_sampler=lambda s: None)
    a, b = req(1, [1] * 8), req(2, [2] * 8)
    b.prompt = list(range(300, 305))  # its own prompt: its cells stay cached apart from a's
    submit(sched, a)
    sched.step()  # a's prompt
    submit(sched, b)
    sched.step()
    assert b.phase is Phase.QUEUED and a.phase is Phase.RUNNING  # b waits: no room beside a
    run_until_idle(sched)
    assert (bytes(a.out), bytes(b.out)) == (b"a" * 8, b"b" * 8)
    assert sched.pool.preemptions == 0
    c = req(3, [1] * 3, prompt_len=60)  # beside a's and b's cached cells it does not fit
    submit(sched, c)
    run_until_idle(sched)
    assert c.phase is Phase.COMPLETED and sched.pool.evictions >= 1
    assert sched.pool.preemptions == 0


def kvpool_growth() -> int:
    from aotx.engine.llama import kvpool
    return kvpool.GROWTH


def test_prompts_being_evaluated_count_against_the_pool() -> None:
    """Three 100-token prompts beside a running request in a 300-cell pool: each
    prompt counts as soon as it starts (not once evaluated), so only those that fit
    start, and nobody is preempted."""
    engine = PoolEngine(300)
    sched = Scheduler(engine, 4, 64, threading.Lock(), make_sampler=lambda r: r,
                      free_sampler=lambda s: None)
    a = req(1, [1] * 40)
    submit(sched, a)
    sched.step()
    late = [req(i, [2] * 4, prompt_len=100) for i in (2, 3, 4)]
    for i, r in enumerate(late):
        r.prompt = list(range(1000 * (i + 1), 1000 * (i + 1) + 100))  # nothing shared
        submit(sched, r)
    run_until_idle(sched)
    assert all(r.phase is Phase.COMPLETED for r in [a, *late])
    assert sched.pool.preemptions == 0


def test_a_reused_sequence_goes_to_host_memory_and_comes_back_for_its_next_turn() -> None:
    """One sequence, two principals taking turns: each turn's sequence held the other's
    conversation, which is saved first; a principal's next turn gets its own back and
    evaluates only the new tokens.  Another principal's same prompt restores nothing."""
    sched, engine = make(slots=1, spill_bytes=1 << 20)
    history = list(range(500, 600))  # alice's 100 tokens

    def turn(principal: int, name: int, prompt: list[int]) -> Request:
        r = of(principal, req(name, [1, 1]))
        r.prompt = prompt
        submit(sched, r)
        run_until_idle(sched)
        assert r.phase is Phase.COMPLETED
        return r

    turn(1, 1, history)
    turn(2, 2, list(range(700, 780)))  # bob's turn: alice's cells are saved
    assert engine.saved == [0] and sched.spill.spills == 1
    (entry,) = sched.spill.entries.values()
    assert entry.owner == 1 and entry.tokens == [*history, 1, 1]  # prompt and its reply
    again = turn(1, 3, [*history, 1, 1, 42, 43])  # alice's next turn
    assert engine.restored == [(0, b"kv0-" * 100)]
    assert sched.spill.restores == 1
    assert again.reused_tokens == 102  # the history and the reply
    assert engine.saved == [0, 0]  # bob's 80 tokens went out first
    turn(3, 4, [*history, 1, 1, 42, 43])  # carol, with alice's exact prompt
    assert sched.spill.restores == 1  # alice's cells are not hers
    turn(2, 5, list(range(700, 780)))  # bob again (his own cells back): carol's go out
    assert sched.spill.restores == 2
    engine.restore_fails = True  # the pool has no room for alice's cells this time
    refused = turn(1, 6, [*history, 1, 1, 42, 43, 1, 1, 7])
    assert sched.spill.restores == 2 and refused.reused_tokens == 0  # evaluated anew
    assert engine.restored[-1][1] == b"kv0-" * 100  # (alice's, tried)


def test_with_a_spill_store_a_short_prefix_is_worth_a_long_conversation_saved() -> None:
    """As test_another_principal_takes_an_empty_sequence_over_ones_private_cells, with a
    spill store: principal 2 reuses the public prefix in sequence 0 instead of taking the
    empty one, and principal 1's conversation there goes to host memory, not lost."""
    sched, _ = make(slots=2, spill_bytes=1 << 20)
    mine, theirs = private_then_other(sched)
    assert (theirs.seq, theirs.reused_tokens) == (0, len(PUBLIC))
    (entry,) = sched.spill.entries.values()
    assert entry.owner == 1 and entry.tokens[:110] == mine.prompt
    run_until_idle(sched)
