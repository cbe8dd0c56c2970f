"""Constrained decoding without a model: llguidance over a byte-level vocabulary (token
1 + b is byte b, token 0 is EOS), the compile cache and its errors, the mask, and the
scheduler applying masks, consuming tokens and stopping where the grammar ends.

tests/e2e/test_grammar_engine.py drives the real model.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pytest
from llguidance import LLTokenizer, TokenizerWrapper

from aotx.engine.grammar import (
    ENFORCED,
    JSON_OPTIONS,
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    MaskFiller,
    Matcher,
    apply_mask,
    check_schema,
    mask_words,
)
from aotx.engine.llama.scheduler import Failure, Request, Scheduler
from aotx.wire import Finish, Phase

from .test_scheduler import ScriptedEngine, run_until_idle, submit

EOS = 0


class _Bytes:
    """The least tokenizer llguidance takes: one token per byte, EOS special."""

    eos_token_id = EOS
    bos_token_id = None

    def __init__(self) -> None:
        self.tokens = [b"\xff<eos>"] + [bytes([b]) for b in range(256)]
        self.special_token_ids = [EOS]

    def __call__(self, data: bytes | str) -> list[int]:
        raw = data.encode() if isinstance(data, str) else data
        return [1 + b for b in raw]


def tok(text: str) -> list[int]:
    return [1 + b for b in text.encode()]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(LLTokenizer(TokenizerWrapper(_Bytes())))


def allowed(row: np.ndarray[Any, Any], n: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), count=n, bitorder="little")
    return {int(t) for t in np.flatnonzero(bits)}


def accepts(compiler: GrammarCompiler, schema: dict[str, Any], text: str) -> bool:
    m = compiler.matcher(GrammarSpec.json_schema(schema))
    return all(m.consume(t) for t in tok(text)) and m.can_stop


# -- compiling and refusing -------------------------------------------------------

@pytest.mark.parametrize(("schema", "bad", "good"), [
    ({"type": "integer", "minimum": 2, "maximum": 5}, "7", "3"),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "1", "0.5"),
    ({"type": "integer", "multipleOf": 3}, "4", "6"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"', '"ab"'),
    ({"type": "string", "pattern": "^[a-z]+@x$"}, '"A@x"', '"ab@x"'),
    ({"type": "string", "format": "date"}, '"abc"', '"2020-01-02"'),
    ({"enum": [1, "a", None]}, "2", "null"),
    ({"const": "k"}, '"j"', '"k"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     "[1, 2, 3, 4]", "[1, 2]"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a", "b"]',
     '["a"]'),
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, "[1, 2]",
     "[1]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}",
     '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": False}, '{"b": 1}', "{}"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, '{"ab": "x"}',
     '{"ab": 1}'),
    ({"type": "object", "minProperties": 1, "maxProperties": 1}, "{}", '{"a": 1}'),
    ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"x"', "true"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true", "1"),
    ({"allOf": [{"type": "integer", "minimum": 2}, {"maximum": 5}]}, "7", "3"),
    ({"$ref": "#/$defs/p", "$defs": {"p": {"type": "integer", "maximum": 1}}}, "2", "1"),
    ({"$ref": "#/definitions/p", "definitions": {"p": {"type": "boolean"}}}, "1", "false"),
])
def test_every_enforced_keyword_is_enforced(compiler: GrammarCompiler, schema: dict[str, Any],
                                            bad: str, good: str) -> None:
    assert not accepts(compiler, schema, bad)
    assert accepts(compiler, schema, good)


def test_the_enforced_table_is_what_is_tested() -> None:
    """Every keyword of ENFORCED appears in this file's table above, so that a keyword
    added to the allowlist comes with a test of its enforcement."""
    import pathlib

    text = pathlib.Path(__file__).read_text()
    table = text[text.index("@pytest.mark.parametrize"):text.index("def test_every_enforced")]
    missing = [kw for kw in ENFORCED if f'"{kw}"' not in table]
    assert not missing, missing


@pytest.mark.parametrize(("schema", "code", "where"), [
    ({"type": "array", "uniqueItems": True}, "unsupported", "#"),
    ({"type": "object", "properties": {"a b/c": {"maxlength": 3}}}, "unsupported",
     "#/properties/a b~1c"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "integer"}}]}, "unsupported", "#/anyOf/1"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "unsupported", "#"),
    ({"type": "object", "x-guidance": {"lenient": True}}, "unsupported", "#"),
    ({"properties": []}, "invalid", "#"),
    ({"items": 3}, "invalid", "#/items"),
])
def test_keywords_that_would_not_be_enforced_are_refused_by_name(
        schema: dict[str, Any], code: str, where: str) -> None:
    with pytest.raises(GrammarError) as info:
        GrammarSpec.json_schema(schema)
    assert info.value.code == code and info.value.where == where
    assert where in str(info.value)


@pytest.mark.parametrize(("schema", "code", "words"), [
    ({"type": "string", "format": "bogus"}, "unsupported", "bogus"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "unsupported",
     "oneOf constraints are not supported: use anyOf"),
    ({"type": "string", "pattern": "(unclosed"}, "invalid", "regex parse error in '(unclosed'"),
    ({"type": "string", "pattern": "(["}, "invalid", "in '([': unclosed character class"),
    ({"type": "string", "pattern": "(" + "\\w" * 12000}, "invalid", "...': unclosed group"),
    ({"$ref": "#/$defs/missing"}, "invalid", "missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "invalid", ""),
])
def test_what_llguidance_refuses_is_a_grammar_error(compiler: GrammarCompiler,
                                                    schema: dict[str, Any], code: str,
                                                    words: str) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(GrammarSpec.json_schema(schema))
    assert info.value.code == code, info.value
    assert words in info.value.detail
    assert "coerce_one_of" not in info.value.detail  # no option a request could set
    assert len(info.value.detail) < 200  # a refusal fits its packet, whatever the pattern


def test_limits_refuse_deep_large_and_complex_schemas_quickly(compiler: GrammarCompiler) -> None:
    import time

    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):  # far past Python's recursion limit: the walk is iterative
        deep = {"type": "array", "items": deep}
    t0 = time.monotonic()
    with pytest.raises(GrammarError) as info:
        GrammarSpec.json_schema(deep)
    assert info.value.code == "too_deep"
    with pytest.raises(GrammarError) as info:
        GrammarSpec.json_schema({"enum": [f"value-{i}" for i in range(100_000)]})
    assert info.value.code == "too_large"
    assert time.monotonic() - t0 < 2.0
    # Under the size limit, llguidance's own fuel bounds the rest.
    tight = GrammarCompiler(compiler.tokenizer, GrammarLimits(initial_lexer_fuel=10_000))
    with pytest.raises(GrammarError) as info:
        tight.compile(GrammarSpec.json_schema({"enum": [f"v{i}" for i in range(3000)]}))
    assert info.value.code == "too_complex"
    with pytest.raises(GrammarError) as info:
        GrammarSpec.lark("start: " + "x" * 70_000)
    assert info.value.code == "too_large"


def test_check_schema_accepts_booleans_and_annotations() -> None:
    check_schema(True, 4)
    check_schema({"title": "T", "description": "d", "default": 1, "examples": [1],
                  "$schema": "https://json-schema.org/draft/2020-12/schema",
                  "properties": {"not": {"type": "integer"}, "x": False}}, 4)


def test_compiled_grammars_are_cached_by_canonical_text(compiler: GrammarCompiler) -> None:
    small = GrammarCompiler(compiler.tokenizer, GrammarLimits(cache_size=2))
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}}}
    first = small.compile(GrammarSpec.json_schema(a))
    again = small.compile(GrammarSpec.json_schema(dict(a)))  # an equal dict: a cache hit
    assert first is again and (small.hits, small.misses) == (1, 1)
    # Property order is output order (llguidance keeps it): another order, another grammar.
    swapped = {"type": "object", "properties": {"y": {"type": "boolean"}, "x": {"type": "integer"}}}
    assert GrammarSpec.json_schema(swapped).key != GrammarSpec.json_schema(a).key
    small.compile(GrammarSpec.json_schema(swapped))
    small.compile(GrammarSpec.json_object())
    assert small.compile(GrammarSpec.json_schema(a)) is not first  # evicted (LRU of 2)
    assert small.misses == 4
    # Each request's matcher is its own copy.
    m1, m2 = first.matcher(), first.matcher()
    assert m1.consume(tok("{")[0]) and not m2.can_stop and m2.consume(tok("{")[0])


def test_failed_compiles_are_not_cached(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec.json_schema({"type": "string", "format": "nope"})
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile(spec)


# -- masks ------------------------------------------------------------------------

def test_mask_allows_eos_only_where_the_grammar_accepts(compiler: GrammarCompiler) -> None:
    m = compiler.matcher(GrammarSpec.regex("a+"))
    n = compiler.n_vocab
    row = np.zeros(mask_words(n), dtype=np.int32)
    m.fill(row)
    assert allowed(row, n) == {tok("a")[0]} and not m.can_stop
    assert m.consume(tok("a")[0])
    m.fill(row)
    assert allowed(row, n) == {tok("a")[0], EOS} and m.can_stop and not m.finished
    done = compiler.matcher(GrammarSpec.json_schema({"const": 1}))
    assert done.consume(tok("1")[0]) and done.finished
    done.fill(row)
    assert allowed(row, n) == {EOS}


def test_a_token_outside_the_mask_puts_the_matcher_in_error(compiler: GrammarCompiler) -> None:
    m = compiler.matcher(GrammarSpec.json_object())
    assert not m.consume(tok("x")[0])
    assert m.error


def test_apply_mask_sets_disallowed_logits_to_minus_infinity() -> None:
    n = 70
    logits = np.arange(n, dtype=np.float32)
    bits = np.zeros(mask_words(n), dtype=np.int32)
    for t in (3, 33, 64):
        bits[t // 32] |= 1 << (t % 32)
    apply_mask(logits, bits)
    assert int(logits.argmax()) == 64
    assert {int(t) for t in np.flatnonzero(np.isfinite(logits))} == {3, 33, 64}
    assert logits[33] == 33.0  # allowed logits keep their values


def test_mask_filler_fills_rows_in_its_thread(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema({"type": "boolean"}))
    ms = [grammar.matcher(), compiler.matcher(GrammarSpec.regex("[0-9]"))]
    filler = MaskFiller()
    try:
        for _ in range(3):
            filler.start(ms)
            bits = filler.wait()
            assert allowed(bits[0], compiler.n_vocab) == set(tok("tf"))
            assert allowed(bits[1], compiler.n_vocab) == set(tok("0123456789"))
        assert filler.steps == 3 and filler.masks == 6 and filler.fill_ns > 0
        assert filler._thread is not None and filler._thread.name == "aotx-masks"
    finally:
        filler.close()
    assert filler._thread is None


# -- the scheduler ----------------------------------------------------------------

class MaskedEngine(ScriptedEngine):
    """Tokens are bytes (1 + b) and 0 is EOS.  Each sample takes the request's next list
    of preferred tokens and returns the first the mask allows (the first, unmasked),
    which is what an arg-max over masked logits does; it records each call's mask."""

    def __init__(self) -> None:
        super().__init__()
        self.masked: list[tuple[bytes, set[int] | None]] = []

    def sample(self, sampler: object, index: int, mask: Any = None) -> int:
        req = sampler
        assert isinstance(req, Request)
        prefs = req.prefs.pop(0) if req.prefs else [EOS]  # type: ignore[attr-defined]
        ok = None if mask is None else allowed(mask, 257)
        self.masked.append((req.identity, ok))
        return next((t for t in prefs if ok is None or t in ok), -99)

    def piece(self, token: int) -> bytes:
        return bytes([token - 1])

    def is_eog(self, token: int) -> bool:
        return token == EOS


def make(slots: int = 4) -> tuple[Scheduler, MaskedEngine]:
    engine = MaskedEngine()
    return Scheduler(engine, slots, 64, threading.Lock(), make_sampler=lambda r: r,
                     free_sampler=lambda s: None), engine


def req(name: int, prefs: list[list[int]], matcher: Matcher | None = None,
        max_tokens: int = 100) -> Request:
    r = Request(identity=bytes([name]) * 16, principal=1, revision=1, role=1,
                prompt=list(range(1, 6)), max_tokens=max_tokens, matcher=matcher)
    r.prefs = prefs  # type: ignore[attr-defined]
    return r


def test_masks_apply_before_sampling_and_the_grammar_end_stops(
        compiler: GrammarCompiler) -> None:
    sched, engine = make()
    # The model "prefers" x, then y, then the digit; only digits are allowed.
    spec = GrammarSpec.json_schema({"type": "array", "items": {"enum": [1, 2]},
                                    "minItems": 2, "maxItems": 2})
    prefs = [tok("x") + tok(c) for c in "[1, 2]"] + [tok("zzz")] * 5
    constrained = req(1, prefs, compiler.matcher(spec))
    free = req(2, [tok("x")] * 3)
    submit(sched, constrained)
    submit(sched, free)
    run_until_idle(sched)
    assert bytes(constrained.out) == b"[1, 2]"
    # It ends at the grammar's end, with no EOS sampled: six samples, no seventh.
    assert (constrained.phase, constrained.finish, constrained.sampled) == (
        Phase.COMPLETED, Finish.STOP, 6)
    # The other request is sampled without a mask and is unaffected.
    assert bytes(free.out) == b"xxx" and free.finish is Finish.STOP
    assert all(ok is None for who, ok in engine.masked if who == free.identity)
    masks = [ok for who, ok in engine.masked if who == constrained.identity]
    assert len(masks) == 6 and masks[0] == set(tok("["))  # each step's mask, in order
    assert sched.masks.masks == 6


def test_eos_is_taken_only_where_the_grammar_accepts(compiler: GrammarCompiler) -> None:
    sched, _ = make()
    r = req(1, [[EOS] + tok("a")] * 4, compiler.matcher(GrammarSpec.regex("a+")))
    submit(sched, r)
    run_until_idle(sched)
    # EOS is preferred but masked at the first step; allowed (and taken) at the second.
    assert bytes(r.out) == b"a" and r.finish is Finish.STOP and r.sampled == 2


def test_a_finished_grammar_at_max_tokens_is_a_stop(compiler: GrammarCompiler) -> None:
    sched, _ = make()
    done = req(1, [tok("7")], compiler.matcher(GrammarSpec.json_schema({"enum": [7]})),
               max_tokens=1)
    cut = req(2, [tok("[")], compiler.matcher(GrammarSpec.json_schema({"type": "array"})),
              max_tokens=1)
    submit(sched, done)
    submit(sched, cut)
    run_until_idle(sched)
    assert done.finish is Finish.STOP and bytes(done.out) == b"7"
    assert cut.finish is Finish.LENGTH and bytes(cut.out) == b"["


def test_a_matcher_in_error_fails_its_request_alone(compiler: GrammarCompiler) -> None:
    sched, _ = make()
    broken = compiler.matcher(GrammarSpec.json_object())
    broken.consume(tok("x")[0])  # as a matcher past llguidance's step limits would be
    bad = req(1, [tok("{")], broken)
    good = req(2, [tok("o"), tok("k")])
    submit(sched, bad)
    submit(sched, good)
    run_until_idle(sched)
    assert bad.phase is Phase.FAILED and bad.failure is Failure.GRAMMAR
    assert good.phase is Phase.COMPLETED and bytes(good.out) == b"ok"


def test_steps_without_constrained_requests_never_start_the_mask_thread() -> None:
    sched, engine = make()
    submit(sched, req(1, [tok("a")] * 3))
    run_until_idle(sched)
    assert sched.masks._thread is None and sched.masks.steps == 0
    assert all(ok is None for _, ok in engine.masked)


# -- %json schemas inside Lark grammars ------------------------------------------------

def test_lark_json_schemas_are_checked_and_compact(compiler: GrammarCompiler) -> None:
    """A ``%json`` inside a Lark grammar passes the same allowlist as a JSON schema
    (``where`` counts the directives) and is compiled with JSON_OPTIONS."""
    lark = ('start: TEXT | call\nTEXT: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n'
            'call: "<tool_call>" (a | b) "</tool_call>"\n'
            'a: %json {"type": "object", "properties": {"x": {"type": "integer"}}, '
            '"required": ["x"], "additionalProperties": false}\nb: %json {"type": "array"}\n')
    spec = GrammarSpec.lark(lark)
    assert spec.source.count('"x-guidance"') == 2

    def run(text: str) -> bool:
        m = compiler.matcher(spec)
        return all(m.consume(t) for t in tok(text)) and m.can_stop

    assert run('<tool_call>{"x": 3}</tool_call>')
    assert not run('<tool_call>{"x":3}</tool_call>')  # compact: one space after ":"
    assert not run('<tool_call>{"x": "3"}</tool_call>')
    assert run("plain text")
    assert not run('plain <tool_call>{"x": 3}</tool_call>')  # calls only from the start
    for bad, code, where in [
            ('start: %json {"type": "string", "maxlength": 3}', "unsupported", "%json[0]#"),
            ('start: a | b\na: %json {}\nb: %json {"properties": {"p": {"x-guidance": {}}}}',
             "unsupported", "%json[1]#/properties/p"),
            ('start: "%json" %json {}', "invalid", "%json[0]"),
            ('start: %json {"type": ', "invalid", "%json[0]")]:
        with pytest.raises(GrammarError) as info:
            GrammarSpec.lark(bad)
        assert (info.value.code, info.value.where) == (code, where), bad
    assert GrammarSpec.lark("start: %json true").source.endswith('"x-guidance":' + json.dumps(
        JSON_OPTIONS, separators=(",", ":")) + "}")


def test_a_think_block_closes_when_the_model_closes_it_or_its_budget_ends(
        compiler: GrammarCompiler) -> None:
    """The schema after thinking (device/constraints.py).  The model may close the block
    whenever it likes, after text that holds the tag's first bytes too (before, only
    the budget could close it), and at any tokenization of the tag: with the tag as the
    thought's ``stop`` and then again as text, llguidance panicked computing the mask
    once ``</think`` was written (every such request failed); once the budget is spent
    the matcher forces the tag (engine/closing.py).  At most four blanks come before the
    answer: a model that would write newline after newline there (SmolLM2 after
    gpt-oss's final channel, greedy, on an Intel CPU) must start its answer instead of
    spending max_tokens on blanks."""
    from types import SimpleNamespace

    from aotx.device.constraints import constraint_matcher
    from aotx.wire import STATE_FLAG_THINKS, Constraint, GrammarKind

    schema = Constraint(GrammarKind.JSON_SCHEMA, '{"type": "integer"}')
    model: Any = SimpleNamespace(grammars=compiler, engine=SimpleNamespace(
        token_bytes=lambda t: bytes([t - 1]), applies_grammar=False))

    def matcher(budget: int) -> Matcher:
        m = constraint_matcher(model, schema, STATE_FLAG_THINKS, budget)
        assert m is not None
        return m

    def run(text: str) -> bool:
        m = matcher(40)
        return all(m.consume(t) for t in tok(text)) and m.can_stop

    assert run("<think>hm</think>\n\n7") and run("<think>hm</think>7")
    assert run("<think>a</b </thin</think>7")  # the tag's first bytes, then the tag
    assert run("<think>hm</think> \n\t\n7") and not run("<think>hm</think>\n\n\n\n\n7")
    assert not run("<think>hm</think>\n\n")  # an answer is due
    row = np.zeros(mask_words(compiler.n_vocab), dtype=np.int32)
    m = matcher(40)
    assert all(m.consume(t) for t in tok("<think>hm</think"))  # the tag but its last byte
    m.fill(row)
    assert not m.error and tok(">")[0] in allowed(row, compiler.n_vocab)
    m = matcher(12)
    assert all(m.consume(t) for t in tok("<think>" + "a" * 12))  # the budget, spent

    def choices() -> set[int]:
        m.fill(row)
        return allowed(row, compiler.n_vocab)

    forced = b""
    while len(only := choices()) == 1:  # (one token allowed: the closing's)
        token = only.pop()
        forced += bytes([token - 1])
        assert m.consume(token)
    assert forced == b"</think>" and m.closing is not None and m.closing.left == -1
    assert all(m.consume(t) for t in tok("\n42")) and m.can_stop  # then the answer, free
    m = matcher(12)  # the budget spent inside the tag: its rest is forced
    assert all(m.consume(t) for t in tok("<think>" + "a" * 8 + "</th"))
    forced = b""
    while len(only := choices()) == 1:
        token = only.pop()
        forced += bytes([token - 1])
        assert m.consume(token)
    assert forced == b"ink>"
    # an engine that applies the grammar itself (vLLM): a closing of several tokens gets
    # the suffix form and no budget (llguidance fails on the stop form there) ...
    model.engine.applies_grammar = True
    m = matcher(12)
    assert m.closing is None and m.spec is not None and "max_tokens" not in m.spec.source
    assert all(m.consume(t) for t in tok("<think>" + "a" * 20 + "</think"))
    m.fill(row)
    assert not m.error
    # ... and a closing of one token llguidance's own budget, which it closes
    from aotx.device.constraints import after_thinking
    m = compiler.matcher(GrammarSpec.lark(after_thinking(schema, False, 12, ("<", "|"),
                                                         stop=True).text))
    assert all(m.consume(t) for t in tok("<" + "a" * 11))  # (the stop's token counts)
    assert choices() == set(tok("|"))


def test_a_pattern_whose_repetitions_outgrow_the_lexer_is_refused_at_once() -> None:
    """Issue 39, finding 3: ^(x{1000}){1000}$ compiled, then failed mid-generation (a
    state per x written); now refused before admission, wherever the pattern stands."""
    from aotx.engine.grammar import GrammarError, check_schema
    from aotx.engine.regex_size import MAX_EXPANDED, expanded_size

    assert expanded_size("^(x{1000}){1000}$") > MAX_EXPANDED
    assert expanded_size(r"^\d{4}-\d{2}-\d{2}$") == 12 and expanded_size("(ab){2,5}") == 10
    assert expanded_size(r"\p{L}+") == 1  # Unicode classes and named groups respelt
    assert expanded_size(r"^(\p{L}x{1000}){1000}$") > MAX_EXPANDED
    assert expanded_size(r"^(?<n>x{1000}){1000}$") > MAX_EXPANDED
    assert expanded_size(r"[^]x{3}{4}") == 12  # unreadable still: as if the counts nested
    for schema, where in (
            ({"type": "string", "pattern": "^(x{1000}){1000}$"}, "#/pattern"),
            ({"type": "object", "properties": {"a": {"type": "string",
                                                     "pattern": "(a{200}b{200}){100}"}}},
             "#/properties/a/pattern"),
            ({"type": "object", "patternProperties": {"(k{500}){50}": {}}},
             "#/patternProperties/(k{500}){50}")):
        with pytest.raises(GrammarError) as err:
            check_schema(schema, 32)
        assert err.value.code == "too_complex" and err.value.where == where
    check_schema({"type": "string", "pattern": "^[a-z]{1,5000}$"}, 32)  # large, but fine
    # 500 alternatives of ~55 each: one lexer holds them all (llguidance ran out of
    # expressions on the fifth token); 500 of ~30 each still compile and match
    many = {"anyOf": [{"type": "string", "pattern": f"^[a-z ]{{1,40}}[0-9]{{0,4}}x{i}$"}
                      for i in range(500)]}
    with pytest.raises(GrammarError) as err:
        check_schema(many, 32)
    assert err.value.code == "too_complex" and "schema's patterns" in err.value.detail
    check_schema({"anyOf": [{"type": "string", "pattern": f"^[a-z]{{1,20}}[0-9]{{0,4}}x{i}$"}
                            for i in range(500)]}, 32)


class _SlowMatcher:
    """A matcher whose masks take 10 ms each (a heavy schema's), allowing every token."""

    words, owner = 1, 0

    def fill(self, row: Any) -> None:
        time.sleep(0.010)
        row[:] = -1


def test_a_principals_masks_take_at_most_their_share_while_others_run() -> None:
    """Issue 39, finding 3: one principal's costly masks set every step's pace.  Alone,
    its rows always have their turn; beside another principal's, its masks fill at most
    MASK_SHARE of the wall time (plus the burst and one mask's overdraft), and the rows
    held back are counted."""
    from aotx.engine.grammar import MASK_BURST_NS, MASK_SHARE, MaskFiller

    masks, m = MaskFiller(), _SlowMatcher()
    try:
        assert all(masks.turn(m, 7, shared=False) for _ in range(5))  # type: ignore[arg-type]
        assert masks.turn(None, 7, shared=True) and masks.deferred == 0  # plain rows: always
        t0, ran = time.perf_counter_ns(), 0
        fill0 = masks.fill_ns
        while time.perf_counter_ns() - t0 < 600_000_000:
            if masks.turn(m, 7, shared=True):  # type: ignore[arg-type]
                masks.start([m])  # type: ignore[list-item]
                masks.wait()
                ran += 1
            else:
                time.sleep(0.005)  # the other principal's step
        wall, filled = time.perf_counter_ns() - t0, masks.fill_ns - fill0
        assert filled <= MASK_SHARE * wall + MASK_BURST_NS + 2 * 15_000_000, (filled, wall)
        assert masks.deferred > 0 and ran >= 3  # held back, not starved
        assert filled < 0.6 * wall  # (unbounded, the masks filled nearly all of it)
    finally:
        masks.close()
