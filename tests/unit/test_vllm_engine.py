"""The vLLM engine's device side (engine/vllm.py, engine/hfvocab.py) against a scripted
``EngineClient`` and a scripted vocabulary: no vLLM installed.  The same code runs on
the real vLLM in tests/vllm/."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from aotx.device.models import ModelConfigError, load_specs
from aotx.engine.interface import EngineError
from aotx.engine.request import Failure, Request
from aotx.engine.vllm.hfvocab import HfVocab, Vocab
from aotx.engine.vllm.model import start
from aotx.engine.vllm.runner import VllmRunner, unsupported
from aotx.wire import EngineFeature, Finish, Phase, Sampling

BOS, EOS, A, B = 0, 1, 2, 3  # specials; a byte b is token b + 4
SPECIALS = (("<s>", BOS), ("</s>", EOS), ("<|a|>", A), ("<|ab|>", B))


def vocab() -> HfVocab:
    return HfVocab(Vocab(n_vocab=260, specials=SPECIALS, eog=frozenset({EOS}), bos=BOS,
                         add_bos=True, chat_template="{{ messages }}",
                         encode=lambda text: [b + 4 for b in text.encode()],
                         token_bytes=lambda t: bytes([t - 4])), context=64)


def tokens(data: bytes) -> list[int]:
    return [b + 4 for b in data]


def test_markup_alone_is_parsed_for_special_tokens() -> None:
    v = vocab()
    ids = v.tokenize_pieces([("<|ab|>u:", True), ("x<|a|>", False), ("<|a|>", True)])
    assert ids == [BOS, B, *tokens(b"u:x<|a|>"), A]
    assert v.specials("a<|ab|>b<|a|><s>") == [B, A, BOS]
    assert v.tokenize("hi", add_special=False) == tokens(b"hi")
    assert v.piece(A) == b"" and v.piece(tokens(b"z")[0]) == b"z"
    assert v.token_text(EOS) == "</s>" and v.is_eog(EOS) and not v.is_eog(A)
    assert v.metadata("tokenizer.chat_template") == "{{ messages }}"


def test_a_rerankers_pair_and_where_its_document_starts() -> None:
    """A reranker's input is the tokenizer's pair; the document's tokens (type 1) start
    after the first separator, where the tokenizer gives token types at all."""
    import dataclasses

    with pytest.raises(NotImplementedError):
        vocab().rank_prompt("q", "d")  # a tokenizer that joins no pair
    joined = dataclasses.replace(vocab().vocab, second_after=B, pair=lambda q, d: [
        A, *tokens(q.encode()), B, *tokens(d.encode()), B])
    v = HfVocab(joined, context=64)
    ids = v.rank_prompt("q", "d")
    assert ids == [A, *tokens(b"q"), B, *tokens(b"d"), B] and v.second_segment(ids) == 3
    assert v.second_segment([A, *tokens(b"q")]) is None  # (no separator)
    untyped = HfVocab(dataclasses.replace(joined, second_after=-1), context=64)
    assert untyped.second_segment(ids) is None


def out(ids: list[int], reason: str | None = None) -> Any:
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason,
                                                    logprobs=None)],
                           finished=reason is not None)


class ScriptedClient:
    """``generate`` yields the script's outputs (a pause before each); records aborts."""

    def __init__(self, script: list[Any], pause: float = 0.0,
                 fail: Exception | None = None) -> None:
        self.script, self.pause, self.fail = script, pause, fail
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.loras: list[Any] = []
        self.added: list[Any] = []

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *,
                       lora_request: Any = None) -> AsyncIterator[Any]:
        self.prompts.append(prompt["prompt_token_ids"])
        self.loras.append(lora_request)
        for item in self.script:
            await asyncio.sleep(self.pause)
            if self.fail is not None:
                raise self.fail
            yield item

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def add_lora(self, lora_request: Any) -> bool:
        self.added.append(lora_request)
        return lora_request.lora_name != "broken"

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class Running:
    """A runner on its own engine thread; ``steps`` counts on_step calls."""

    def __init__(self, client: ScriptedClient) -> None:
        self.lock = threading.Lock()
        self.steps = 0
        self.ended: list[Request] = []
        self.runner = VllmRunner(client, vocab(), self.lock, make_params=lambda r: r,
                                 on_step=self._step, on_terminal=self.ended.append)
        self.thread = threading.Thread(target=self.runner.run, daemon=True)
        self.thread.start()

    def _step(self) -> None:
        self.steps += 1

    def submit(self, **kw: Any) -> Request:
        req = Request(identity=os.urandom(16), principal=1, revision=1,
                      role=kw.pop("role", 2), prompt=[BOS, *tokens(b"hi")],
                      max_tokens=kw.pop("max_tokens", 32), **kw)
        with self.lock:
            self.runner.submit(req)
        return req

    def wait(self, until: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    def close(self) -> None:
        self.runner.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def running() -> Any:
    made: list[Running] = []

    def make(client: ScriptedClient) -> Running:
        made.append(Running(client))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_tokens_become_bytes_at_utf8_boundaries_and_the_length_ends_it(running: Any) -> None:
    e_acute = "é".encode()  # two bytes, sent in two outputs
    client = ScriptedClient([out(tokens(b"ab") + [tokens(e_acute)[0]]),
                             out([tokens(e_acute)[1]]), out(tokens(b"!"), "length")])
    r = running(client)
    req = r.submit(max_tokens=5)
    r.wait(lambda: req.phase.terminal)
    assert req.phase is Phase.COMPLETED and req.finish is Finish.LENGTH
    assert bytes(req.out) == b"ab" + e_acute + b"!" and req.sampled == 5
    assert client.prompts == [[BOS, *tokens(b"hi")]]
    assert client.aborted == []  # vLLM ended it: nothing to abort
    assert r.steps >= 3 and r.ended == [req]
    assert r.runner.stats.tokens_out == 5 and r.runner.stats.finished["completed"] == 1
    assert r.runner.stats.ttft.count == 1 and r.runner.stats.itl.count == 4


def test_a_split_character_is_not_published_early(running: Any) -> None:
    e_acute = "é".encode()
    client = ScriptedClient([out(tokens(b"a") + [tokens(e_acute)[0]]),
                             out([tokens(e_acute)[1]], "stop")], pause=0.2)
    r = running(client)
    req = r.submit()
    r.wait(lambda: req.sampled == 2)
    with r.lock:
        assert bytes(req.out) == b"a"  # the lead byte is held back
    r.wait(lambda: req.phase.terminal)
    assert bytes(req.out) == b"a" + e_acute and req.finish is Finish.STOP


def test_a_stop_string_or_max_tokens_ends_it_here_and_aborts_vllm(running: Any) -> None:
    client = ScriptedClient([out(tokens(b"one END two")), out(tokens(b"more"))])
    r = running(client)
    stopped = r.submit(stops=(b"END",))
    r.wait(lambda: stopped.phase.terminal)
    assert bytes(stopped.out) == b"one " and stopped.finish is Finish.STOP
    capped = r.submit(max_tokens=3)
    r.wait(lambda: capped.phase.terminal)
    assert bytes(capped.out) == b"one" and capped.finish is Finish.LENGTH
    r.wait(lambda: len(client.aborted) == 2)
    assert client.aborted == [stopped.identity.hex(), capped.identity.hex()]


def test_a_lora_alias_names_its_adapter_to_vllm(running: Any) -> None:
    client = ScriptedClient([out(tokens(b"ok"), "stop")])
    r = running(client)
    adapter = SimpleNamespace(lora_name="adapter-of-role-3")
    r.runner.loras[3] = adapter
    plain = r.submit()
    r.wait(lambda: plain.phase.terminal)
    adapted = r.submit(role=3)
    r.wait(lambda: adapted.phase.terminal)
    assert client.loras == [None, adapter]


def test_end_of_generation_token_completes_it(running: Any) -> None:
    r = running(ScriptedClient([out(tokens(b"ok") + [EOS], "stop")]))
    req = r.submit()
    r.wait(lambda: req.phase.terminal)
    assert bytes(req.out) == b"ok" and req.finish is Finish.STOP and req.sampled == 3


def test_cancel_ends_it_and_aborts_vllm(running: Any) -> None:
    client = ScriptedClient([out(tokens(b"x"))] * 50, pause=0.05)
    r = running(client)
    req = r.submit(max_tokens=100)
    r.wait(lambda: req.sampled >= 2)
    with r.lock:
        r.runner.cancel(req)
    r.wait(lambda: req.phase.terminal)
    assert req.phase is Phase.CANCELLED and req.sampled < 50
    r.wait(lambda: client.aborted == [req.identity.hex()])
    assert r.runner.depth == 0


def test_a_cancel_right_after_the_submit_ends_it(running: Any) -> None:
    """Submit and cancel in one pass of the control thread (one lock hold): the request
    ends cancelled, and nothing stays behind.  (The loop thread may start it between the
    two calls, which take no turn on the loop: then vLLM saw it and was told to abort.)"""
    client = ScriptedClient([out(tokens(b"x"))] * 50, pause=0.05)
    r = running(client)
    req = Request(identity=os.urandom(16), principal=1, revision=1, role=2,
                  prompt=[BOS], max_tokens=100)
    with r.lock:
        r.runner.submit(req)
        r.runner.cancel(req)
    r.wait(lambda: req.phase.terminal)
    assert req.phase is Phase.CANCELLED and r.ended == [req]
    time.sleep(0.1)
    assert r.runner.depth == 0 and not r.runner._tasks
    assert client.aborted == ([req.identity.hex()] if client.prompts else [])


def test_vllm_errors_and_aborts_are_not_reported_as_answers(running: Any) -> None:
    r = running(ScriptedClient([out(tokens(b"cut"), "error")]))
    failed = r.submit()
    r.wait(lambda: failed.phase.terminal)
    assert failed.phase is Phase.FAILED and failed.failure is Failure.DECODE
    r = running(ScriptedClient([out(tokens(b"cut"), "abort")]))
    aborted = r.submit()
    r.wait(lambda: aborted.phase.terminal)
    assert aborted.phase is Phase.CANCELLED


def test_an_engine_error_fails_the_request_alone(running: Any) -> None:
    r = running(ScriptedClient([out(tokens(b"x"))], fail=RuntimeError("engine core died")))
    req = r.submit()
    r.wait(lambda: req.phase.terminal)
    assert req.phase is Phase.FAILED and req.failure is Failure.DECODE
    assert r.runner.depth == 0


def test_requests_submitted_before_the_loop_runs_are_started() -> None:
    lock = threading.Lock()
    client = ScriptedClient([out(tokens(b"early"), "stop")])
    runner = VllmRunner(client, vocab(), lock, make_params=lambda r: r)
    req = Request(identity=os.urandom(16), principal=1, revision=1, role=2, prompt=[BOS],
                  max_tokens=8)
    with lock:
        runner.submit(req)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not req.phase.terminal and time.monotonic() < deadline:
            time.sleep(0.005)
        assert bytes(req.out) == b"early"
    finally:
        runner.stop()
        thread.join(5)


def test_a_runner_stopped_before_its_thread_runs_still_ends() -> None:
    runner = VllmRunner(ScriptedClient([]), vocab(), threading.Lock(), make_params=lambda r: r)
    runner.stop()
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()


def test_what_the_engine_lacks_is_named() -> None:
    assert unsupported(Sampling(last_n=64)) is EngineFeature.PENALTY_WINDOW
    assert unsupported(Sampling(top_k=5, presence=0.5, logprobs=3, bias=((7, 1.0),))) is None


def lp(logprob: float, rank: int) -> Any:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_logprobs_become_the_annotation_stream(running: Any) -> None:
    """vLLM's per-token dicts (sampled token plus the top k, by rank) become the same
    annotation lines as llama.cpp's: offset, token, logprob, bytes, top likeliest first."""
    x, y, z = tokens(b"xyz")
    first = {x: lp(-0.5, 2), y: lp(-0.25, 1), z: lp(-3.0, 3)}  # x sampled, not likeliest
    second = {y: lp(-0.1, 1), z: lp(-0.1, 2)}  # a tie: by token id
    client = ScriptedClient([SimpleNamespace(outputs=[SimpleNamespace(
        token_ids=[x, y, EOS], finish_reason="stop",
        logprobs=[first, second, {EOS: lp(-0.2, 1)}])], finished=True)])
    r = running(client)
    req = r.submit(sampling=Sampling(logprobs=3))  # k + 1: two alternatives
    r.wait(lambda: req.phase.terminal)
    assert bytes(req.out) == b"xy"
    assert req.notes is not None
    lines = [json.loads(ln) for ln in bytes(req.notes.data).splitlines()]
    assert lines == [
        {"offset": 0, "token": x, "logprob": -0.5, "bytes": list(b"x"),
         "top": [[y, -0.25, list(b"y")], [x, -0.5, list(b"x")]]},
        {"offset": 1, "token": y, "logprob": -0.1, "bytes": list(b"y"),
         "top": [[y, -0.1, list(b"y")], [z, -0.1, list(b"z")]]}]


def test_without_vllm_a_vllm_model_is_refused_with_the_remedy(tmp_path: Any) -> None:
    pytest.importorskip("llama_cpp")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    with pytest.raises(EngineError, match=r"a Python with aotx\[vllm\]"):
        start(str(tmp_path), {})


def write_models(tmp_path: Any, body: str) -> str:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "models.toml").write_text("[default]\nenabled = false\n" + body)
    return str(tmp_path)


def test_models_file_declares_the_engine_and_passes_vllm_settings(tmp_path: Any) -> None:
    state = write_models(tmp_path, '[[model]]\nalias = "big"\nengine = "vllm"\npath = "m"\n'
                         '[model.vllm]\ntensor_parallel_size = 2\nmax_model_len = 8192\n'
                         'distributed_executor_backend = "ray"\n')
    (spec,) = load_specs(state)
    assert spec.engine == "vllm" and spec.path == os.path.realpath(tmp_path / "m")
    assert dict(spec.vllm) == {"tensor_parallel_size": 2, "max_model_len": 8192,
                               "distributed_executor_backend": "ray"}


def test_a_vllm_embedding_model_runs_vllms_pooling_runner(tmp_path: Any) -> None:
    state = write_models(tmp_path, '[[model]]\nalias = "e"\nengine = "vllm"\npath = "m"\n'
                         'kind = "embedding"\n[model.vllm]\n'
                         'pooler_config = {pooling_type = "MEAN"}\n')
    (spec,) = load_specs(state)
    assert spec.kind == "embedding"
    assert dict(spec.vllm) == {"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}}


def test_lora_adapters_become_aliases_after_their_base(tmp_path: Any) -> None:
    for name in ("sql", "chat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    state = write_models(tmp_path, '[[model]]\nalias = "big"\nengine = "vllm"\npath = "m"\n'
                         '[[model.lora]]\nalias = "big-sql"\npath = "sql"\n'
                         '[[model.lora]]\nalias = "big-chat"\npath = "chat"\n')
    base, sql, chat = load_specs(state)
    assert (base.role, sql.role, chat.role) == (1, 2, 3)
    assert sql.lora_of == chat.lora_of == "big" and base.lora_of is None
    assert sql.path == os.path.realpath(tmp_path / "sql") and sql.engine == "vllm"
    assert dict(base.vllm) == {"enable_lora": True, "max_loras": 2}


def test_a_hugging_face_cache_snapshot_is_the_model_folder(tmp_path: Any) -> None:
    """In a Hugging Face cache a snapshot's files are links into blobs/: the folder is
    the snapshot, not where its config.json leads."""
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "f00d").write_text("{}")
    (snap / "config.json").symlink_to(blobs / "f00d")
    (tmp_path / "models.toml").write_text(
        f'[default]\nenabled = false\n[[model]]\nalias = "x"\nengine = "vllm"\n'
        f'path = "{snap}"\n')
    (spec,) = load_specs(str(tmp_path))
    assert spec.path == os.path.realpath(snap)


def test_a_pinned_vllm_folder_that_differs_stops_the_load(tmp_path: Any) -> None:
    import dataclasses

    from aotx.device.loading import load_model

    (spec,) = load_specs(write_models(tmp_path, '[[model]]\nalias = "x"\nengine = "vllm"\n'
                                                'path = "m"\n'))
    with pytest.raises(ModelConfigError, match="the models file pins"):
        load_model(dataclasses.replace(spec, sha256="0" * 64), str(tmp_path),
                   threading.Lock(), lambda: None, lambda r: None)


@pytest.mark.parametrize("body, message", [
    ('engine = "vllm"\npath = "m"\nslots = 4\n', "max_num_seqs"),
    ('path = "m/config.json"\n[[model.lora]]\nalias = "x"\npath = "m"\n',
     'need engine = "vllm"'),
    ('engine = "vllm"\npath = "m"\n[[model.lora]]\nalias = "x"\npath = "m"\n',
     "adapter_config.json"),
    ('engine = "vllm"\npath = "m"\n[model.vllm]\nmodel = "other"\n', "unknown vLLM settings"),
    ('engine = "vllm"\npath = "m"\nkv_budget = "1GiB"\n', "kv_budget is a llama.cpp setting"),
    ('engine = "vllm"\npath = "m/config.json"\n', "Hugging Face model folder"),
    ('engine = "vllm"\npath = "m"\nkind = "embedding"\nembedding_context = 64\n',
     "embedding_context is a llama.cpp setting"),
    ('engine = "vllm"\npath = "m"\n[model.vllm]\npooler_config = {}\n',
     'pooler_config is for kind = "embedding"'),
    ('engine = "vllm"\npath = "m"\nkind = "embedding"\n[[model.lora]]\nalias = "x"\n'
     'path = "m"\n', "adapters need a chat model"),
    ('engine = "tgi"\npath = "m"\n', 'engine is "llama" or "vllm"'),
    ('path = "m/config.json"\n[model.vllm]\nmax_model_len = 8\n', 'need engine = "vllm"'),
])
def test_models_file_refuses_what_vllm_cannot_take(tmp_path: Any, body: str,
                                                   message: str) -> None:
    state = write_models(tmp_path, '[[model]]\nalias = "big"\n' + body)
    with pytest.raises(ModelConfigError, match=message):
        load_specs(state)


class EncodingClient(ScriptedClient):
    """``encode`` answers each input with a vector of its tokens' sum and count (vLLM's
    PoolingRequestOutput shape), after ``pause``; an input of ``bad`` fails."""

    def __init__(self, pause: float = 0.0, bad: int = -1, dims: int = 3) -> None:
        super().__init__([])
        self.pause, self.bad, self.dims = pause, bad, dims
        self.encoded: list[list[int]] = []
        self.params: list[Any] = []  # each input's pooling parameters
        self.running = self.peak = 0  # encode calls in flight, and the most at once

    async def encode(self, prompt: Any, pooling_params: Any,
                     request_id: str) -> AsyncIterator[Any]:
        ids = prompt["prompt_token_ids"]
        self.encoded.append(ids)
        self.params.append(pooling_params)
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.pause)
        self.running -= 1
        if self.bad in ids:
            raise RuntimeError("the engine failed")
        row = [float(sum(ids)), float(len(ids)), 0.0][:self.dims]
        yield SimpleNamespace(outputs=SimpleNamespace(data=row), finished=True)


def embed_all(client: EncodingClient, inputs: list[list[int]], pooling: str = "mean",
              dims: int = 0) -> Any:
    import numpy as np

    from aotx.engine.embedding import EmbedJob
    from aotx.engine.vllm.inputs import VllmEmbeddings

    run = Running(client)
    try:
        # (the parameters say where an input's second segment starts: after token 3)
        emb = VllmEmbeddings(run.runner, client, dims or client.dims, 64, pooling,
                             lambda second: ("params", second),
                             lambda tokens: tokens.index(3) + 1 if 3 in tokens else None)
        done: list[EmbedJob] = []
        job = EmbedJob(inputs, done.append)
        with run.lock:
            emb.submit(job)
        run.wait(lambda: bool(done))
        assert done == [job] and emb.embedder is emb
        return job, np
    finally:
        run.close()


def test_embeddings_go_to_vllms_encode_together_and_come_back_unit_length() -> None:
    client = EncodingClient(pause=0.3)
    job, np = embed_all(client, [[3, 4], [6], [1, 1, 1]])
    assert client.peak == 3  # concurrently: every input's encode in flight at once
    assert sorted(map(tuple, client.encoded)) == [(1, 1, 1), (3, 4), (6,)]
    assert job.error == "" and job.tokens == 6 and job.next == 3
    for row, (total, count) in zip(job.vectors, [(7, 2), (6, 1), (3, 3)], strict=True):
        assert np.allclose(row, np.array([total, count, 0]) / np.hypot(total, count))


def test_a_rerankers_scores_come_back_as_the_head_gives_them_with_token_types() -> None:
    """A reranker (pooling "rank") on vLLM: one score an input, not normalized (a score
    of 7 stays 7, not 1), each input's parameters told where its document starts."""
    client = EncodingClient(dims=1)
    job, np = embed_all(client, [[2, 5, 3, 2], [2, 9]], pooling="rank")
    assert job.error == "" and np.array_equal(job.vectors, [[12.0], [11.0]])
    assert sorted(client.params, key=str) == [("params", 3), ("params", None)]


def test_a_failed_embedding_input_fails_the_call_not_the_runner() -> None:
    job, _ = embed_all(EncodingClient(bad=9), [[1], [9]])
    assert job.error == "the engine failed"
    job, _ = embed_all(EncodingClient(dims=2), [[1]], dims=3)  # vLLM's width is not the model's
    assert "2 floats, not 3" in job.error


def test_media_go_to_vllm_with_the_prompt_and_its_expansion_is_counted() -> None:
    """A request with decoded media: vLLM gets them as ``multi_modal_data`` beside the
    token ids, and the prompt vLLM's processor expanded is the one the usage counts."""
    from aotx.engine.multimodal import MediaSegment

    seen: list[Any] = []

    class MediaClient(ScriptedClient):
        async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *,
                           lora_request: Any = None) -> AsyncIterator[Any]:
            seen.append(prompt)
            first = out(tokens(b"x"))
            first.prompt_token_ids = [BOS, 9, 9, 9, 9, *tokens(b"hi")]
            yield first
            yield out(tokens(b"y"), "stop")

    run = Running(MediaClient([]))
    try:
        segs = [MediaSegment(0, 1, "image", decoded="red"),
                MediaSegment(0, 1, "audio", decoded="beep"),
                MediaSegment(0, 1, "image", decoded="blue")]
        req = run.submit(segments=segs)
        run.wait(lambda: req.phase.terminal)
    finally:
        run.close()
    assert seen[0]["multi_modal_data"] == {"image": ["red", "blue"], "audio": ["beep"]}
    assert seen[0]["prompt_token_ids"] == [BOS, *tokens(b"hi")]
    assert len(req.prompt) == 7 and run.runner.stats.prompt_tokens_in == 7
    assert bytes(req.out) == b"xy" and req.segments == []


def test_a_dead_engine_is_reported_once_by_the_health_check() -> None:
    """vLLM's ``check_health`` raises once its engine core is gone: the runner calls
    ``on_fatal`` with the reason, once, and its loop goes on (the device stops it)."""
    class Dying(ScriptedClient):
        dead = False

        async def check_health(self) -> None:
            if self.dead:
                raise RuntimeError("EngineCore encountered an issue")

    client = Dying([])
    reports: list[str] = []
    lock = threading.Lock()
    runner = VllmRunner(client, vocab(), lock, make_params=lambda r: r)
    runner.on_fatal, runner.health_s = reports.append, 0.01
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)
        assert reports == []  # healthy: checked, nothing said
        client.dead = True
        deadline = time.monotonic() + 5
        while not reports:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        assert reports == ["its vLLM engine died: EngineCore encountered an issue"]
    finally:
        runner.stop()
        thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("names, fatal", [(["sql", "chat"], []),
                                          (["sql", "broken"], ["'broken' did not load"])])
def test_adapters_are_loaded_before_the_first_request(names: list[str],
                                                     fatal: list[str]) -> None:
    client = ScriptedClient([out(tokens(b"ok"), "stop")])
    reports: list[str] = []
    lock = threading.Lock()
    runner = VllmRunner(client, vocab(), lock, make_params=lambda r: r)
    runner.on_fatal = reports.append
    runner.loras = {2 + i: SimpleNamespace(lora_name=n) for i, n in enumerate(names)}
    req = Request(identity=os.urandom(16), principal=1, revision=1, role=3,
                  prompt=[BOS, *tokens(b"hi")], max_tokens=8)
    with lock:
        runner.submit(req)  # before the loop: it waits for the adapters
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not req.phase.terminal:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        runner.stop()
        thread.join(5)
    assert [a.lora_name for a in client.added] == names[:2]
    assert [f for f in fatal if not any(f in r for r in reports)] == [] and len(reports) == len(fatal)
    assert client.loras == [runner.loras[3]]
