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
