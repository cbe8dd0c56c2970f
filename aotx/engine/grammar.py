"""Constrained decoding: grammars compiled by llguidance into per-request token masks.

A :class:`GrammarCompiler` is built once per model from the engine's vocabulary.  It
compiles a :class:`GrammarSpec` (a JSON schema, "any JSON object", a Lark grammar or a
regular expression) into a :class:`Grammar`, cached by the hash of the spec's canonical
text; each request takes its own :class:`Matcher` from it (a copy of the compiled
parser, microseconds).  The scheduler asks every constrained request's matcher for the
allowed-token bitmask of its next token while ``llama_decode`` runs (:class:`MaskFiller`,
a worker thread: llguidance drops the GIL while it computes, and so does the decode),
then :func:`apply_mask` writes -inf into the disallowed logits before the arg-max or
the sampler chain, and the matcher consumes the sampled token.

Compilation can take up to a few hundred milliseconds for a large schema: call
:meth:`GrammarCompiler.compile` off the engine thread and outside the device lock (it
is thread-safe; llguidance drops the GIL while it builds the parser).  Every failure,
an invalid schema, a keyword that is not enforced, a limit, is a :class:`GrammarError`
naming what was wrong; nothing is silently left unenforced.

Only this module of aotx imports ``llguidance`` (tests/unit/test_layout.py).
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from ..config import MAX_CONSTRAINT_BYTES, MAX_SCHEMA_DEPTH
from .closing import Closing
from .masks import apply_mask, mask_words
from .regex_size import MAX_EXPANDED, expanded_size


class GrammarError(ValueError):
    """A grammar that cannot be compiled or enforced.

    ``code`` is one of ``invalid`` (not a schema, grammar or regex llguidance can read),
    ``unsupported`` (a keyword or feature that would not be enforced), ``too_large``
    (the source is over ``GrammarLimits.max_source_bytes``), ``too_deep`` (nesting over
    ``max_depth``) or ``too_complex`` (llguidance's compile limits); ``where`` is a JSON
    pointer into the schema (``#/properties/tags``) where one applies, else "";
    ``detail`` says what, in words fit for a 400 answer.
    """

    def __init__(self, code: str, detail: str, where: str = "") -> None:
        super().__init__(f"{detail} at {where}" if where else detail)
        self.code = code
        self.detail = detail
        self.where = where


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what a request may ask to compile, and on each step's mask."""

    max_source_bytes: int = MAX_CONSTRAINT_BYTES  # a schema's canonical JSON, a grammar
    max_depth: int = MAX_SCHEMA_DEPTH  # nested schema objects (properties in properties)
    cache_size: int = 64  # compiled grammars kept (LRU)
    # llguidance's own limits (LLParserLimits).  Fuel is work: ~50k units/ms while the
    # lexer is built, ~14k/ms in a mask step; a lexer state costs 1-2 kB and a cached
    # grammar keeps the states its requests built (shared by its matchers), so
    # max_lexer_states x cache_size bounds the cache (20k x 2 kB x 64: 2.5 GB in
    # theory).  Measured (bench/bench_grammar_memory.py): 64 distinct 37 KB schemas
    # built to grow the lexer, each walked 400 tokens, took 116 MiB.  The step limits
    # bound what one sequence's mask can add to a batched step (a few ms).
    # llguidance's defaults: 1M, 200k, 50k, 250k, 500k.
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 100_000
    step_max_items: int = 50_000
    max_lexer_states: int = 20_000
    max_grammar_size: int = 200_000

    def parser_limits(self) -> LLParserLimits:
        return LLParserLimits(initial_lexer_fuel=self.initial_lexer_fuel,
                              step_lexer_fuel=self.step_lexer_fuel,
                              step_max_items=self.step_max_items,
                              max_lexer_states=self.max_lexer_states,
                              max_grammar_size=self.max_grammar_size,
                              verbose_errors=False)


#: JSON output is compact apart from one space after "," and ":" (as the model writes
#: JSON itself; flexible whitespace lets a small model emit newlines forever).  Passed as
#: llguidance's *overrides*, so a schema's "x-guidance" key cannot loosen them: not
#: ``lenient`` (which ignores unimplemented keywords) nor ``coerce_one_of`` (which
#: enforces oneOf as anyOf).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": ", "lenient": False,
                                "coerce_one_of": False}

#: Keywords that llguidance enforces (its docs/json_schema.md, checked by tests/unit/
#: test_grammar.py).  Property order is fixed to the schema's, which narrows the outputs
#: but never lets an invalid one through.
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "allOf", "oneOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties", "items", "prefixItems", "additionalItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
#: Keywords that constrain nothing (annotations): accepted and not enforced by design.
ANNOTATIONS = frozenset({
    "$schema", "$id", "$comment", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding",
    "discriminator"})  # OpenAPI's hint beside a oneOf, which is what is enforced
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "items")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: ``kind`` (json_schema, lark or regex) and its canonical text.

    Build one with :meth:`json_schema`, :meth:`json_object`, :meth:`lark` or
    :meth:`regex`; ``key`` (a SHA-256 of kind and text) names it in the cache.
    """

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool,
                    limits: GrammarLimits | None = None) -> GrammarSpec:
        """A JSON schema (a dict, as decoded from the request).  Checked here: depth,
        size and keywords (:func:`check_schema`); raises :class:`GrammarError`."""
        limits = limits or GrammarLimits()
        check_schema(schema, limits.max_depth)
        try:
            # Key order is kept, not sorted: llguidance emits properties in the
            # schema's order, so two orders are two grammars.
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise GrammarError("invalid", f"the schema is not JSON: {exc}") from None
        _check_size(text, limits)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        return cls("json_schema", '{"type":"object"}')

    @classmethod
    def lark(cls, text: str, limits: GrammarLimits | None = None) -> GrammarSpec:
        """An llguidance Lark grammar (docs/syntax.md of llguidance).  Every ``%json``
        schema inside it is checked as :meth:`json_schema` checks one (a refusal's
        ``where`` is ``%json[i]#/pointer``, i counting the directives from 0) and is
        compiled with :data:`JSON_OPTIONS` (written in as its ``x-guidance``)."""
        limits = limits or GrammarLimits()
        _check_size(text, limits)
        return cls("lark", _checked_lark(text, limits))

    @classmethod
    def regex(cls, text: str, limits: GrammarLimits | None = None) -> GrammarSpec:
        _check_size(text, limits or GrammarLimits())
        return cls("regex", text)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


_JSON_DIRECTIVE = re.compile(r"%json\b\s*")


def _checked_lark(text: str, limits: GrammarLimits) -> str:
    """``text`` with each ``%json`` schema checked (:func:`check_schema`) and rewritten
    compact with :data:`JSON_OPTIONS` as its ``x-guidance``.  A ``%json`` not followed
    by JSON (one in a string literal or a comment, too) is refused: no schema is left
    unchecked."""
    out: list[str] = []
    pos = count = 0
    decoder = json.JSONDecoder()
    for found in _JSON_DIRECTIVE.finditer(text):
        if found.start() < pos:
            continue
        where = f"%json[{count}]"
        try:
            schema, end = decoder.raw_decode(text, found.end())
        except ValueError:
            raise GrammarError("invalid", "%json must be followed by a JSON schema",
                               where) from None
        try:
            check_schema(schema, limits.max_depth)
        except GrammarError as exc:
            raise GrammarError(exc.code, exc.detail, where + (exc.where or "#")) from None
        if schema is True:
            schema = {}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        try:
            canonical = json.dumps(schema, ensure_ascii=False, separators=(",", ":"),
                                   allow_nan=False)
        except ValueError as exc:
            raise GrammarError("invalid", f"the schema is not JSON: {exc}", where) from None
        out += [text[pos:found.end()], canonical]
        pos = end
        count += 1
    return "".join(out) + text[pos:]


def _check_size(text: str, limits: GrammarLimits) -> None:
    size = len(text.encode("utf-8"))
    if size > limits.max_source_bytes:
        raise GrammarError("too_large", f"the grammar is {size} bytes, over the limit of "
                           f"{limits.max_source_bytes}")


def check_schema(schema: object, max_depth: int) -> None:
    """Refuse what llguidance would not enforce: any keyword outside :data:`ENFORCED`
    and :data:`ANNOTATIONS` (an unknown keyword is an annotation to JSON Schema, so a
    misspelt ``maxlength`` would pass unenforced), a non-schema value, or nesting over
    ``max_depth``.  Walked without recursion, so a deep schema costs no stack."""
    todo: list[tuple[object, str, int]] = [(schema, "#", 0)]
    patterns = [0]  # the patterns' expanded sizes so far (_check_pattern)
    while todo:
        node, where, depth = todo.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise GrammarError("invalid", "a schema must be an object or a boolean", where)
        if depth > max_depth:
            raise GrammarError("too_deep", f"schemas nest deeper than {max_depth}", where)
        for key, value in node.items():
            if key not in ENFORCED and key not in ANNOTATIONS:
                raise GrammarError("unsupported", f"keyword {key!r} is not supported", where)
            if key in _SCHEMA_MAPS:
                if not isinstance(value, dict):
                    raise GrammarError("invalid", f"{key!r} must be an object", where)
                todo += [(v, f"{where}/{key}/{_pointer(k)}", depth + 1) for k, v in value.items()]
            elif key in _SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
                if not isinstance(value, list):
                    raise GrammarError("invalid", f"{key!r} must be an array", where)
                todo += [(v, f"{where}/{key}/{i}", depth + 1) for i, v in enumerate(value)]
            elif key in _SCHEMA_ONE:
                todo.append((value, f"{where}/{key}", depth + 1))
            if key == "pattern" and isinstance(value, str):
                _check_pattern(value, f"{where}/pattern", patterns)
            elif key == "patternProperties" and isinstance(value, dict):
                for name in value:
                    _check_pattern(name, f"{where}/patternProperties/{_pointer(name)}",
                                   patterns)


def _check_pattern(pattern: str, where: str, patterns: list[int]) -> None:
    """Refuse a pattern whose counted repetitions, with those of the schema's patterns
    before it (``patterns[0]``: their sum), would need more lexer states than the matcher
    may build (engine/regex_size.py): alternatives are matched at once, in one lexer (500
    patterns of ~55 each ran out of llguidance's expressions mid-generation)."""
    size = expanded_size(pattern)
    patterns[0] += size
    if size > MAX_EXPANDED:
        raise GrammarError("too_complex", f"the pattern's counted repetitions come to more "
                                          f"than {MAX_EXPANDED} characters", where)
    if patterns[0] > MAX_EXPANDED:
        raise GrammarError("too_complex", f"the schema's patterns' counted repetitions come "
                                          f"to more than {MAX_EXPANDED} characters", where)


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        try:
            return LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as exc:
            raise GrammarError("invalid", f"the schema is not JSON: {exc}") from None
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    raise GrammarError("invalid", f"unknown grammar kind {spec.kind!r}")


def _classify(message: str) -> GrammarError:
    """llguidance's error text as a GrammarError (it reports no codes, only words)."""
    first = _first_words(message)
    lowered = first.lower()
    if "unimplemented" in lowered or "not supported" in lowered or "unknown format" in lowered:
        return GrammarError("unsupported", first)
    if any(w in lowered for w in ("too big", "too large", "limit", "fuel", "too complex")):
        return GrammarError("too_complex", first)
    return GrammarError("invalid", first)


#: llguidance's advice that names an option of its own, which no request can set.
_ONE_OF_ADVICE = ". Enable 'coerce_one_of' option to approximate oneOf with anyOf"


def _first_words(message: str) -> str:
    """The words of llguidance's message fit for a 400: its first line, and for the
    regex parser's (``regex parse error:``, the pattern, a caret line, ``error: why``)
    the pattern and the cause, which its first line alone leaves out."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "the grammar failed"
    first = lines[0].strip()
    if first.endswith(":") and len(lines) > 1:
        cause = next((line.strip()[6:].strip() for line in lines[2:]
                      if line.strip().startswith("error:")), "")
        # the pattern as llguidance rewrote it (\d as [0-9]), cut: the refusal travels in
        # one packet, and a pattern can fill one
        pattern = lines[1].strip()
        pattern = pattern if len(pattern) <= 60 else pattern[:57] + "..."
        first = f"{first[:-1]} in {pattern!r}" + (f": {cause}" if cause else "")
    return first.replace(_ONE_OF_ADVICE, ": use anyOf")


class Matcher:
    """One request's position in its grammar (engine thread only).

    The scheduler calls :meth:`fill` for the next token's bitmask, :meth:`consume`
    with the token sampled, and ends the request when :attr:`finished`.  End-of-
    generation tokens are allowed by the mask only where :attr:`can_stop`.
    """

    __slots__ = ("_m", "spec_key", "words", "spec", "owner", "closing")

    def __init__(self, matcher: LLMatcher, spec_key: str, n_vocab: int,
                 spec: GrammarSpec | None = None) -> None:
        self._m = matcher
        self.spec_key = spec_key
        self.words = mask_words(n_vocab)  # int32 words in one bitmask row
        self.spec = spec  # what was compiled (an engine that applies it itself: vLLM)
        self.owner = 0  # whose request: the principal its masks' time is charged to
        self.closing: Closing | None = None  # a think block's budget (engine/closing.py)

    def fill(self, row: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        """Write the allowed-token bitmask for the next token into ``row`` (int32,
        ``mask_words(n_vocab)`` long; bit t of word t // 32 set: token t allowed)."""
        forced = self.closing.next if self.closing is not None else None
        if forced is not None:  # (the think block's closing, once its budget is spent)
            row[:] = 0
            row.view(np.uint32)[forced >> 5] = 1 << (forced & 31)
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False puts the matcher in :attr:`error`."""
        ok = bool(self._m.consume_token(token))
        if ok and self.closing is not None:
            self.closing.passed(token)
        return ok

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more: the request must stop."""
        return bool(self._m.is_stopped())

    @property
    def can_stop(self) -> bool:
        """The output so far is a complete sentence of the grammar (EOS allowed)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher failed (a step limit, a token outside the mask), or ""."""
        return str(self._m.get_error()) if self._m.is_error() else ""


class Grammar:
    """A compiled grammar: its pristine matcher, warmed by one mask (llguidance builds
    parts of the lexer lazily, and copies share them)."""

    def __init__(self, spec: GrammarSpec, matcher: LLMatcher, n_vocab: int) -> None:
        self.spec = spec
        self.n_vocab = n_vocab
        self._pristine = matcher

    def matcher(self) -> Matcher:
        """A new request's matcher at the grammar's start (a copy: ~10-100 us)."""
        return Matcher(self._pristine.deep_copy(), self.spec.key, self.n_vocab, self.spec)


class GrammarCompiler:
    """Compiles grammars for one vocabulary; thread-safe; bounded LRU cache by spec key."""

    def __init__(self, tokenizer: LLTokenizer, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self.n_vocab = int(tokenizer.vocab_size)
        self._parser_limits = self.limits.parser_limits()
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar for ``spec`` (cached); raises :class:`GrammarError`."""
        key = spec.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        t0 = time.perf_counter()
        text = _grammar_text(spec)
        matcher = LLMatcher(self.tokenizer, text, log_level=0, limits=self._parser_limits)
        if not matcher.is_error():
            warm = np.empty(mask_words(self.n_vocab), dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(warm.ctypes.data, warm.nbytes)
        if matcher.is_error():
            raise _classify(matcher.get_error())
        grammar = Grammar(spec, matcher, self.n_vocab)
        with self._lock:
            self.misses += 1
            self.compile_seconds += time.perf_counter() - t0
            self._cache[key] = grammar
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return self.compile(spec).matcher()


#: While other principals' rows share the engine, one principal's masks may take this
#: part of the wall time (its credit grows by it, capped at :data:`MASK_BURST_NS`, and
#: pays each of its masks' fill time); a row of a principal in debt waits a step.
MASK_SHARE = 0.25
MASK_BURST_NS = 20_000_000


class MaskFiller:
    """Fills the bitmasks of one step's constrained samples in a worker thread, so that
    the work overlaps ``llama_decode`` (both drop the GIL).  One per scheduler.

    ``fill_ns`` adds up the worker's time, ``wait_ns`` the time the engine thread still
    waited for it after the decode (the masks' cost on the critical path).

    The mask work is shared between principals (:meth:`turn`): a schema whose masks
    cost more than the decode itself (llguidance's step limits allow ~10 ms a mask)
    would otherwise set every step's pace, everybody's plain rows included.  While
    another principal has plain rows, a principal's constrained rows join a step only
    while its credit is positive: it earns :data:`MASK_SHARE` of the wall time and pays
    what its masks took.  Otherwise its rows are never held back."""

    def __init__(self) -> None:
        self.bits = np.full((0, 0), -1, dtype=np.int32)  # sized by the first step
        self._todo: list[Matcher] = []
        self._go = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._failed: BaseException | None = None
        self.fill_ns = 0
        self.worst_fill_ns = 0  # the longest step's filling
        self.wait_ns = 0
        self.steps = 0
        self.masks = 0
        self.deferred = 0  # constrained rows held back a step (their principal's debt)
        self._credit: dict[int, tuple[float, float]] = {}  # principal -> (ns, when)

    def turn(self, matcher: Matcher | None, principal: int, shared: bool) -> bool:
        """May a row sampled with ``matcher`` (``principal``'s) join this step?  ``shared``:
        another principal has plain (unconstrained, foreground) rows, which are never held
        back, so a step never ends up empty.  (Engine thread, while planning a step.)"""
        if matcher is None:
            return True
        matcher.owner = principal
        now = time.perf_counter_ns()
        credit, since = self._credit.get(principal, (MASK_BURST_NS, now))
        credit = MASK_BURST_NS if not shared else min(
            MASK_BURST_NS, credit + (now - since) * MASK_SHARE)
        self._credit[principal] = (credit, now)
        if credit > 0:
            return True
        self.deferred += 1
        return False

    def _pay(self, matcher: Matcher, took: int) -> None:
        """A mask took ``took`` ns: its principal's credit pays it (the worker thread)."""
        owed = self._credit.get(matcher.owner)
        if owed is not None:
            self._credit[matcher.owner] = (owed[0] - took, owed[1])

    def start(self, matchers: Sequence[Matcher]) -> None:
        """Begin filling row i of :attr:`bits` for ``matchers[i]``."""
        words = matchers[0].words
        if len(matchers) > self.bits.shape[0] or words != self.bits.shape[1]:
            self.bits = np.full((max(len(matchers), self.bits.shape[0]), words), -1,
                                dtype=np.int32)
        self._todo = list(matchers)
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._work, name="aotx-masks", daemon=True)
            self._thread.start()
        self._done.clear()
        self._go.set()

    def wait(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        """Block until every row of the started step is filled; the bitmask rows."""
        t0 = time.perf_counter_ns()
        self._done.wait()
        self.wait_ns += time.perf_counter_ns() - t0
        if self._failed is not None:  # an API misuse (llguidance reports grammar errors
            failed, self._failed = self._failed, None  # through the matcher, not raising)
            raise failed
        self.steps += 1
        self.masks += len(self._todo)
        return self.bits

    def close(self) -> None:
        """Stop the worker thread (it is a daemon: a scheduler that is dropped without
        closing leaves one idle thread)."""
        if self._thread is not None:
            self._todo = []
            self._closing = True
            self._go.set()
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._closing:
                return
            t0 = t = time.perf_counter_ns()
            try:
                for i, m in enumerate(self._todo):
                    m.fill(self.bits[i])
                    now = time.perf_counter_ns()
                    self._pay(m, now - t)
                    t = now
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
                self._failed = exc
            finally:
                took = time.perf_counter_ns() - t0
                self.fill_ns += took
                self.worst_fill_ns = max(self.worst_fill_ns, took)
                self._done.set()


__all__ = ["ANNOTATIONS", "ENFORCED", "Grammar", "GrammarCompiler", "GrammarError",
           "GrammarLimits", "GrammarSpec", "MaskFiller", "Matcher", "apply_mask",
           "check_schema", "mask_words"]
