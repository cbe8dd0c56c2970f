"""The engine thread's embedding queue without a model: how inputs of queued calls are
packed into decodes, the smaller decodes while requests are generated, and failures."""

from __future__ import annotations

import threading

import numpy as np

from aotx.engine.embedding import BUSY_TOKENS, MAX_SEQS, EmbedJob, EmbedQueue
from aotx.engine.llama import EngineError


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
