"""The engine thread's embedding queue without a model: how inputs of queued calls are
packed into decodes, the smaller decodes while requests are generated, and failures."""

from __future__ import annotations

import threading

import numpy as np

from aotx.engine.embedding import (
    BUSY_TOKENS,
    MAX_SEQS,
    PIECE_TOKENS,
    SHARED_TOKENS,
    SHARED_WINDOW,
    EmbedJob,
    EmbedQueue,
)
from aotx.engine.interface import EngineError


class FakeEmbedder:
    """Each input's vector is (its first token, its length, 0...), scaled to unit length
    as the real one scales its pooled vector; every decode's inputs are kept."""

    def __init__(self, context: int = 512, fail: bool = False) -> None:
        self.context, self.dims, self.fail = context, 4, fail
        self.decodes: list[list[list[int]]] = []

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        assert len(inputs) <= MAX_SEQS and sum(map(len, inputs)) <= self.context
        self.decodes.append(inputs)
        if self.fail:
            raise EngineError("llama_decode returned -1")
        out = np.array([[t[0], len(t), 0, 0] for t in inputs], dtype=np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def queue(embedder: FakeEmbedder) -> tuple[EmbedQueue, list[EmbedJob]]:
    done: list[EmbedJob] = []
    return EmbedQueue(embedder, threading.Lock(), lambda: None), done  # type: ignore[arg-type]


def run(q: EmbedQueue, busy: bool = False) -> None:
    while q.pending():
        q.step(busy)


def test_inputs_of_several_calls_share_a_decode_in_order() -> None:
    fake = FakeEmbedder(context=100)
    q, done = queue(fake)
    a = EmbedJob([[1] * 30, [2] * 30], done.append)
    b = EmbedJob([[3] * 30, [4] * 30, [5] * 30], done.append)
    q.submit(a)
    q.submit(b)
    run(q)
    # whole inputs, arrival order, as many as the context holds
    assert [[t[0] for t in d] for d in fake.decodes] == [[1, 2, 3], [4, 5]]
    assert done == [a, b] and not a.error and not b.error
    assert a.tokens == 60 and b.tokens == 90
    for job, firsts in ((a, [1, 2]), (b, [3, 4, 5])):
        want = np.array([[f, 30, 0, 0] for f in firsts], dtype=np.float32)
        want /= np.linalg.norm(want, axis=1, keepdims=True)
        assert np.allclose(job.vectors, want)


def test_busy_decodes_are_small_but_an_input_goes_whole() -> None:
    fake = FakeEmbedder(context=512)
    q, done = queue(fake)
    q.submit(EmbedJob([[1] * 300, [2] * 40, [3] * 40, [4] * 40, [5] * 40], done.append))
    run(q, busy=True)
    sizes = [sum(map(len, d)) for d in fake.decodes]
    assert sizes[0] == 300  # longer than the busy budget: alone, whole
    assert all(s <= BUSY_TOKENS for s in sizes[1:]) and sum(sizes) == 460
    fake.decodes.clear()
    q.submit(EmbedJob([[1] * 40] * 6, done.append))
    run(q, busy=False)  # idle: one decode takes them all
    assert len(fake.decodes) == 1


def test_a_decode_holds_at_most_max_seqs_inputs() -> None:
    fake = FakeEmbedder(context=4096)
    q, done = queue(fake)
    q.submit(EmbedJob([[7]] * (MAX_SEQS + 3), done.append))
    run(q)
    assert [len(d) for d in fake.decodes] == [MAX_SEQS, 3]


def test_a_failed_decode_fails_the_calls_in_it() -> None:
    fake = FakeEmbedder(fail=True)
    q, done = queue(fake)
    a, b = EmbedJob([[1, 2]], done.append), EmbedJob([[3]], done.append)
    q.submit(a)
    q.submit(b)
    run(q)
    assert done == [a, b] and "llama_decode" in a.error and "llama_decode" in b.error


def test_an_input_longer_than_the_context_fails_instead_of_spinning() -> None:
    q, done = queue(FakeEmbedder(context=8))
    job = EmbedJob([[1] * 9], done.append)
    q.submit(job)
    q.step()
    assert done == [job] and job.error and not q.pending()


def test_while_busy_embeddings_take_at_most_their_share_of_the_thread() -> None:
    now = [0.0]
    fake = FakeEmbedder(context=512)
    real = fake.embed

    def slow(inputs: list[list[int]]) -> np.ndarray:
        now[0] += 0.3  # a decode of 0.3 s
        return real(inputs)

    fake.embed = slow  # type: ignore[method-assign]
    done: list[EmbedJob] = []
    q = EmbedQueue(fake, threading.Lock(), lambda: None, clock=lambda: now[0])  # type: ignore[arg-type]
    q.submit(EmbedJob([[1] * 60] * 3, done.append))
    q.step(busy=True)
    assert len(fake.decodes) == 1
    now[0] += 0.2  # decode steps for 0.2 s: not its turn yet
    q.step(busy=True)
    assert len(fake.decodes) == 1
    now[0] += 0.1  # 0.3 s of steps after a 0.3 s decode: its turn
    q.step(busy=True)
    assert len(fake.decodes) == 2
    q.step(busy=False)  # nothing generated: no waiting
    assert len(fake.decodes) == 3 and done


def test_another_principals_call_is_in_the_next_decode_however_much_is_queued() -> None:
    """M has queued 20 calls of four 100-token inputs; B's call, queued after them, is
    in the very next decode, first, and M's inputs fill the rest of it."""
    fake = FakeEmbedder(context=512)
    q, done = queue(fake)
    flood = [EmbedJob([[9] * 100] * 4, done.append, principal=7) for _ in range(20)]
    for job in flood:
        q.submit(job)
    q.step()
    assert [len(t) for t in fake.decodes[0]] == [100] * 5  # M alone: the context's worth
    b = EmbedJob([[5] * 3], done.append, principal=8)
    q.submit(b)
    q.step()
    assert b in done and not b.error and done.index(b) <= 2
    assert [t[0] for t in fake.decodes[1]].count(5) == 1
    assert sum(map(len, fake.decodes[1])) == 503  # B's 3 tokens, then five of M's inputs
    run(q)
    assert len(done) == 21 and all(j.next == 4 and not j.error for j in flood)


def test_principals_get_equal_tokens_of_a_decode_while_both_wait() -> None:
    fake = FakeEmbedder(context=400)
    q, done = queue(fake)
    for _ in range(3):
        q.submit(EmbedJob([[1] * 50] * 8, done.append, principal=1))
    q.submit(EmbedJob([[2] * 50] * 8, done.append, principal=2))
    q.step()
    firsts = [t[0] for t in fake.decodes[0]]
    assert firsts.count(1) == firsts.count(2) == 4  # max-min: 200 tokens each
    q.step()
    firsts = [t[0] for t in fake.decodes[1]]
    assert firsts.count(1) == firsts.count(2) == 4  # principal 2's call ends here
    q.step()
    assert [t[0] for t in fake.decodes[2]] == [1] * 8  # alone again: all of it


def test_a_principals_inputs_keep_their_order_and_none_is_skipped() -> None:
    """A principal whose next input does not fit waits for the next decode; another
    principal's smaller inputs fill the room (none of the first's is taken out of turn)."""
    fake = FakeEmbedder(context=100)
    q, done = queue(fake)
    q.submit(EmbedJob([[1] * 60, [2] * 60, [3] * 10], done.append, principal=1))
    q.submit(EmbedJob([[4] * 10] * 6, done.append, principal=2))
    run(q)
    order = [t[0] for d in fake.decodes for t in d if t[0] in (1, 2, 3)]
    assert order == [1, 2, 3]
    assert all(sum(map(len, d)) <= 100 for d in fake.decodes)


def test_a_withdrawn_call_is_answered_at_once_and_never_embedded() -> None:
    fake = FakeEmbedder(context=100)
    q, done = queue(fake)
    a = EmbedJob([[1] * 100] * 3, done.append, principal=1)
    b = EmbedJob([[2] * 10], done.append, principal=2)
    q.submit(a)
    q.submit(b)
    q.withdraw(a)
    q.withdraw(a)  # twice: answered once
    assert done == [a] and a.withdrawn and q.withdrawn == 1
    run(q)
    assert done == [a, b] and [t[0] for d in fake.decodes for t in d] == [2]


def test_a_call_withdrawn_while_its_inputs_are_decoded_is_answered_once() -> None:
    """The control thread withdraws a call while the engine thread decodes some of its
    inputs (the decode holds no lock): its answer is the withdrawal, once, and the
    decode's end neither answers it again nor embeds the rest."""
    fake = FakeEmbedder(context=100)
    q, done = queue(fake)
    a = EmbedJob([[1] * 60] * 3, done.append, principal=1)
    q.submit(a)
    real = fake.embed

    def withdrawing(inputs: list[list[int]]) -> np.ndarray:
        q.withdraw(a)  # (the lock is not held during a decode)
        return real(inputs)

    fake.embed = withdrawing  # type: ignore[method-assign]
    q.step()
    assert done == [a] and a.withdrawn and not q.pending() and len(fake.decodes) == 1


class FakePieces:
    """A piece embedder (engine/embed_pieces.py) without a model: an input's vector is
    (its tokens' sum, its length, 0, 0) pooled over its pieces; the cells each sequence
    holds are counted as a KV cache would."""

    chunked = True
    pooling = "mean"

    def __init__(self, context: int = 64) -> None:
        self.context, self.cells, self.dims = context, 2 * context, 4
        self.held: dict[int, list[int]] = {}  # sequence -> its tokens so far
        self.decodes: list[list[tuple[int, int, int, bool]]] = []  # (seq, start, n, last)

    def run(self, pieces: list[tuple[int, list[int], int, bool]]) -> dict[int, np.ndarray]:
        assert sum(len(t) for _, t, _, _ in pieces) <= self.context
        self.decodes.append([(s, start, len(t), last) for s, t, start, last in pieces])
        out = {}
        for seq, tokens, start, last in pieces:
            assert len(self.held.setdefault(seq, [])) == start  # pieces in order
            self.held[seq] += tokens
            assert sum(map(len, self.held.values())) <= self.cells
            if last:
                done = self.held.pop(seq)
                v = np.array([sum(done), len(done), 0, 0], dtype=np.float32)
                out[seq] = v / np.linalg.norm(v)
        return out

    def drop(self, seq: int) -> None:
        self.held.pop(seq, None)


def pieces_queue(context: int = 64) -> tuple[EmbedQueue, FakePieces, list[EmbedJob], list[float]]:
    fake, done, now = FakePieces(context), [], [0.0]
    q = EmbedQueue(fake, threading.Lock(), lambda: None, clock=lambda: now[0])
    return q, fake, done, now


def test_long_inputs_go_in_pieces_and_another_principal_waits_one_small_decode() -> None:
    q, fake, done, now = pieces_queue(context=512)
    flood = [EmbedJob([list(range(512))] * 2, done.append, principal=7) for _ in range(3)]
    for job in flood:
        q.submit(job)
    q.step()
    assert [n for _, _, n, _ in fake.decodes[0]] == [PIECE_TOKENS]  # alone: big pieces
    b = EmbedJob([[1, 2, 3]], done.append, principal=8)
    q.submit(b)
    for _ in range(-(-3 // SHARED_TOKENS)):  # B's tokens go first in every decode
        q.step()
    assert b in done and not b.error
    assert all(sum(n for _, _, n, _ in d) <= SHARED_TOKENS for d in fake.decodes[1:])
    assert np.allclose(b.vectors[0], np.array([6, 3, 0, 0]) / np.linalg.norm([6, 3, 0, 0]))
    while q.pending():
        q.step()
        assert sum(n for _, _, n, _ in fake.decodes[-1]) <= SHARED_TOKENS  # still shared
    want = np.array([sum(range(512)), 512, 0, 0], dtype=np.float32)
    assert all(np.allclose(j.vectors, want / np.linalg.norm(want)) for j in flood)
    now[0] += SHARED_WINDOW  # nobody else lately: big pieces again
    q.submit(EmbedJob([list(range(100))], done.append, principal=7))
    q.step()
    assert fake.decodes[-1][0][2] == PIECE_TOKENS


def test_a_withdrawn_input_in_progress_gives_its_cells_back() -> None:
    q, fake, done, _ = pieces_queue(context=64)
    a = EmbedJob([list(range(64))], done.append, principal=7)
    q.submit(a)
    q.step()  # (no other principal lately: 64 tokens, the whole input)
    assert done == [a] and not fake.held and not q.reserved
    long_job = EmbedJob([list(range(64))] * 2, done.append, principal=7)
    q.submit(long_job)
    q.submit(EmbedJob([[5]], done.append, principal=9))  # shared from now: pieces of 4
    q.step()
    assert q.partial and fake.held and q.reserved[7] == 64
    q.withdraw(long_job)
    assert long_job in done and long_job.withdrawn
    seq = q.partial[7].seq
    q.step()  # the engine thread drops the input in progress first
    assert 7 not in q.partial and 7 not in q.reserved and seq not in fake.held
    while q.pending():
        q.step()
    assert not fake.held and not q.reserved and not q.partial


def test_a_principals_inputs_in_progress_reserve_at_most_the_context() -> None:
    """KV cells: one principal's inputs in progress reserve at most the context, so
    another principal's input always has room."""
    q, fake, done, _ = pieces_queue(context=64)
    for _ in range(4):
        q.submit(EmbedJob([list(range(60))], done.append, principal=7))
    q.submit(EmbedJob([list(range(60))], done.append, principal=8))
    while q.pending():
        q.step()
        assert q.reserved.get(7, 0) <= 64 and sum(q.reserved.values()) <= 128
    assert len(done) == 5 and not any(j.error for j in done) and not fake.held


def test_a_failed_piece_fails_every_input_in_progress() -> None:
    q, fake, done, _ = pieces_queue(context=64)
    a = EmbedJob([list(range(64))], done.append, principal=7)
    b = EmbedJob([list(range(64))], done.append, principal=8)
    q.submit(a)
    q.submit(b)
    q.step()
    q.step()  # a piece of each (turns: the one served least recently first)
    assert len(q.partial) == 2

    def fail(pieces: list[tuple[int, list[int], int, bool]]) -> dict[int, np.ndarray]:
        fake.held.clear()
        raise EngineError("llama_decode returned -3")

    fake.run = fail  # type: ignore[method-assign]
    q.step()
    assert set(done) == {a, b} and a.error and b.error
    assert not q.partial and not q.reserved and not q.pending()


def test_inputs_in_progress_go_on_when_every_sequence_is_taken() -> None:
    """More principals than sequences, each with an input of several pieces: an input in
    progress keeps its sequence, so it goes on however many are taken (issue 39 review:
    a new principal's piece won every tie until all 64 sequences were held)."""
    q, fake, done, _ = pieces_queue(context=64)
    fake.cells = 10_000  # (the KV cache is not what this is about)
    q.embedder.context = 64
    jobs = [EmbedJob([[p] * 9], done.append, principal=p) for p in range(1, MAX_SEQS + 6)]
    for job in jobs:
        q.submit(job)
    for _ in range(2000):
        if not q.pending():
            break
        q.step()
    assert not q.pending() and len(done) == len(jobs) and not any(j.error for j in jobs)
