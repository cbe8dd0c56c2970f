"""Constrained decoding on the real model through the scheduler: sequences under different
JSON schemas and free ones decode in the same batch, greedy and sampled; every constrained
output validates with ``jsonschema``, free outputs are the same as without the constrained
neighbours, and pathological schemas are refused or bounded while other streams run."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotx.engine.grammar import GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec
from aotx.engine.llama.chunking import apart_rows
from aotx.engine.llama.engine import LlamaEngine
from aotx.engine.llama.scheduler import Failure, Request, Scheduler
from aotx.wire import Finish, Phase

pytestmark = pytest.mark.skipif(os.environ.get("AOTX_SKIP_MODEL") == "1",
                                reason="model tests disabled")

SLOTS = 8

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"], "additionalProperties": False},
    "post": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 30},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "minItems": 1, "maxItems": 3},
                       "meta": {"type": "object",
                                "properties": {"draft": {"type": "boolean"},
                                               "score": {"type": "integer", "minimum": 0,
                                                         "maximum": 5}},
                                "required": ["draft"], "additionalProperties": False}},
        "required": ["title", "tags", "meta"], "additionalProperties": False},
    "shape": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                           "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"shape": {"anyOf": [{"const": "dot"},
                                           {"type": "array", "items": {"$ref": "#/$defs/point"},
                                            "minItems": 2, "maxItems": 3}]},
                       "origin": {"$ref": "#/$defs/point"}},
        "required": ["shape", "origin"], "additionalProperties": False},
    "code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                       "when": {"type": "string", "format": "date"},
                       "ok": {"type": "boolean"}},
        "required": ["code", "when"], "additionalProperties": False},
}
FREE = ("Tell me a short story about a cat.", "Describe the sea in a few sentences.")


@dataclass
class Rig:
    engine: LlamaEngine
    compiler: GrammarCompiler
    sched: Scheduler
    render: Any

    def prompt(self, text: str) -> list[int]:
        return self.engine.tokenize(self.render([{"role": "user", "content": text}]), False)

    def run(self, reqs: list[Request]) -> int:
        with self.sched.lock:
            for r in reqs:
                self.sched.submit(r)
        steps = 0
        while self.sched.step():
            steps += 1
            assert steps < 2000
        return steps


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    from aotx.device.models import default_model_path
    from aotx.device.template import ChatTemplate
    from aotx.engine.llama.engine import EngineConfig
    from aotx.engine.llama.sampling import Sampler

    engine = LlamaEngine(EngineConfig(path=default_model_path(), slots=SLOTS, slot_context=768,
                                      batch=256))
    sched = Scheduler(engine, SLOTS, 256, threading.Lock(),
                      make_sampler=lambda r: Sampler(r.temperature, r.top_p, r.seed),
                      free_sampler=lambda s: s.free(), apart_rows=apart_rows(engine))
    tmpl = ChatTemplate(engine.metadata("tokenizer.chat_template"))
    yield Rig(engine, engine.grammar_compiler(), sched, tmpl.render)
    sched.masks.close()
    engine.close()


def request(rig: Rig, n: int, text: str, schema: dict[str, Any] | None, temperature: float,
            seed: int, max_tokens: int = 160) -> Request:
    matcher = None if schema is None else rig.compiler.matcher(GrammarSpec.json_schema(schema))
    return Request(identity=n.to_bytes(16, "big"), principal=1, revision=1, role=1,
                   prompt=rig.prompt(text), max_tokens=max_tokens, temperature=temperature,
                   seed=seed, matcher=matcher)


def assert_valid(r: Request, schema: dict[str, Any]) -> Any:
    text = bytes(r.out).decode()
    assert (r.phase, r.finish) == (Phase.COMPLETED, Finish.STOP), (r.failure, text)
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.2, 1), (1.2, 7), (1.2, 42)])
def test_constrained_and_free_sequences_share_the_batch(rig: Rig, temperature: float,
                                                        seed: int) -> None:
    constrained = [(request(rig, i, f"Reply with JSON for a {name}: {json.dumps(s)}", s,
                            temperature, seed + i), s)
                   for i, (name, s) in enumerate(SCHEMAS.items())]
    free = [request(rig, 10 + i, q, None, temperature, seed + 10 + i, max_tokens=16)
            for i, q in enumerate(FREE)]
    masks_before = rig.sched.masks.masks
    steps = rig.run([r for r, _ in constrained] + free)
    for r, schema in constrained:
        assert_valid(r, schema)
    # One batch: about as many steps as the longest sequence, not the sum (and a step for
    # each prompt: they are evaluated one at a time, in steps of their own).
    assert steps <= max(r.sampled for r, _ in constrained) + len(constrained) + len(free)
    assert rig.sched.masks.masks - masks_before == sum(r.sampled for r, _ in constrained)
    # The free sequences come out as they do alone (no mask touches their logits).
    alone = [request(rig, 20 + i, q, None, temperature, seed + 10 + i, max_tokens=16)
             for i, q in enumerate(FREE)]
    rig.run(alone)
    assert [bytes(r.out) for r in free] == [bytes(r.out) for r in alone]
    assert all(r.sampled == 16 for r in free)


def test_any_json_object(rig: Rig) -> None:
    r = Request(identity=b"j" * 16, principal=1, revision=1, role=1, max_tokens=120,
                prompt=rig.prompt('Answer in JSON: what color is the sky? Use the key "color".'),
                matcher=rig.compiler.matcher(GrammarSpec.json_object()))
    rig.run([r])
    assert isinstance(assert_valid(r, {"type": "object"}), dict)


# -- generated schemas ------------------------------------------------------------

_names = st.sampled_from(["id", "name", "kind", "n", "tags", "ok", "child", "x"])
_leaves = st.one_of(
    st.integers(-50, 50).flatmap(lambda lo: st.integers(lo, lo + 100).map(
        lambda hi: {"type": "integer", "minimum": lo, "maximum": hi})),
    st.integers(0, 3).flatmap(lambda lo: st.integers(lo + 1, lo + 8).map(
        lambda hi: {"type": "string", "minLength": lo, "maxLength": hi})),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", 1, 2, True]), min_size=1, max_size=4,
             unique=True).map(lambda vs: {"enum": vs}),
    st.sampled_from(["a", 3, False]).map(lambda v: {"const": v}),
    st.sampled_from(["^[a-z]{1,5}$", "^[0-9]{3}$", "^(ab|cd)+$"]).map(
        lambda p: {"type": "string", "pattern": p, "maxLength": 8}),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], data: st.DataObject) -> dict[str, Any]:
        keys = list(props)
        required = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}

    return st.builds(build, st.dictionaries(_names, children, min_size=1, max_size=3),
                     st.data())


_schemas = st.recursive(
    _leaves,
    lambda children: st.one_of(
        _objects(children),
        st.integers(0, 2).flatmap(lambda lo: st.integers(lo, lo + 2).flatmap(
            lambda hi: children.map(lambda c: {"type": "array", "items": c, "minItems": lo,
                                                  "maxItems": hi}))),
        st.lists(children, min_size=2, max_size=2).map(lambda cs: {"anyOf": cs}),
    ),
    max_leaves=6,
)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schemas=st.lists(_objects(_schemas), min_size=4, max_size=4),
       seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 1.2]))
def test_generated_schemas_always_yield_valid_output(rig: Rig, schemas: list[dict[str, Any]],
                                                     seed: int, temperature: float) -> None:
    reqs = [request(rig, 30 + i, f"Reply with JSON matching {json.dumps(s)}", s, temperature,
                    seed + i, max_tokens=300) for i, s in enumerate(schemas)]
    rig.run(reqs)
    for r, s in zip(reqs, schemas, strict=True):
        assert_valid(r, s)


# -- pathological input -----------------------------------------------------------

def test_pathological_schemas_are_refused_or_bounded_beside_other_streams(rig: Rig) -> None:
    """Compiles run in another thread while the batch decodes other streams: deep nesting,
    a huge enum and a regex whose counted repetitions outgrow the lexer (issue 39: it
    used to compile and fail its request mid-generation) are refused at once;
    big-but-allowed and catastrophic-regex schemas compile with little lexer work; a
    request under a costly regex does not hold the others back, and no step's masks take
    long beside its decode.

    Work is counted, not timed, where llguidance counts it: its lexer fuel.  Where time
    is the point (the masks beside the decode), the bound is against the decodes of the
    same run, so a slow or loaded machine scales both sides."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    refused: list[str] = []
    compiled: list[str] = []
    # A tenth of the lexer fuel a compile may spend (fuel is llguidance's count of lexer
    # work, ~50k units a millisecond: GrammarLimits): the schemas below must compile
    # within it (the 5000-value enum needs about 56k units, the patterns under 1k).
    frugal = GrammarCompiler(rig.compiler.tokenizer, GrammarLimits(
        initial_lexer_fuel=GrammarLimits().initial_lexer_fuel // 10))

    def compile_all() -> None:
        explosive = {"type": "string", "pattern": "^(([a-z]{1,30}){1,30}){1,30}$"}
        for schema in (deep, {"enum": [f"value-{i}" for i in range(100_000)]}, explosive):
            try:
                rig.compiler.compile(GrammarSpec.json_schema(schema))
            except GrammarError as exc:
                refused.append(exc.code)
        for schema in ({"enum": [f"v{i}" for i in range(5000)]},
                       {"type": "string", "pattern": "^(a+)+$"},
                       {"type": "string", "pattern": "^(x+x+)+y$"},
                       {"type": "string", "pattern": "^(.*a){20}$"}):
            try:
                frugal.compile(GrammarSpec.json_schema(schema))
                compiled.append("ok")
            except GrammarError as exc:
                compiled.append(exc.code)

    costly = {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "string", "pattern": "^(([a-z]{1,8}){1,8}){1,8}$"}}}
    bad = request(rig, 40, "Reply with JSON with a long lowercase word in v.", costly, 1.2, 3)
    free = [request(rig, 41 + i, q, None, 0.0, 0, max_tokens=24) for i, q in enumerate(FREE)]
    worker = threading.Thread(target=compile_all)
    masks = rig.sched.masks
    worst_before, wait_before = masks.worst_fill_ns, masks.wait_ns
    masks.worst_fill_ns = 0
    decodes: list[int] = []  # each step's llama_decode, in ns: what the masks overlap
    decode = rig.engine.decode

    def timed_decode(entries: Any) -> int:
        t = time.perf_counter_ns()
        try:
            return decode(entries)
        finally:
            decodes.append(time.perf_counter_ns() - t)

    rig.engine.decode = timed_decode  # type: ignore[method-assign]
    try:
        worker.start()
        steps = rig.run([bad, *free])
        worker.join()
    finally:
        del rig.engine.decode  # the class's method again
    worst, waited = masks.worst_fill_ns, masks.wait_ns - wait_before
    masks.worst_fill_ns = max(worst_before, worst)
    assert refused == ["too_deep", "too_large", "too_complex"]
    assert compiled == ["ok"] * 4
    assert all(r.phase is Phase.COMPLETED and r.sampled == 24 for r in free)
    # llguidance's lexer limit ends the request, or the grammar is finished in bounds.
    assert bad.phase is Phase.FAILED and bad.failure is Failure.GRAMMAR or (
        bad.finish is Finish.STOP)
    # Nobody was held back: the batch took about the longest request's tokens in steps (a
    # step for each prompt, and one for a request that ends without a token), not more.
    reqs = [bad, *free]
    assert steps <= max(r.sampled for r in reqs) + 2 * len(reqs), steps
    # The masks hide behind the decode they run beside: no step's filling took longer
    # than two typical decodes (a few ms against ~22 ms on 2 cores), and the engine thread's
    # waits for them after its decodes add up to under a tenth of its decode time.
    typical = sorted(decodes)[len(decodes) // 2]
    assert worst <= 2 * typical, (worst, typical)
    assert waited <= sum(decodes) / 10, (waited, sum(decodes))
