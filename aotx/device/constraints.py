"""A submission's constraint (``response_format``, a tool call) as a grammar matcher.

The model's :class:`~aotx.engine.grammar.GrammarCompiler` is built on the first
constrained request (about 0.4 s for a 49k-token vocabulary; no start-up pays it) and
compiles on the media worker, never under the device lock, since a large schema takes
up to a few hundred milliseconds and every decode step needs the lock.

A constraint that cannot be compiled or enforced is refused with 400 ``GRAMMAR``; the
reply's payload says why, as UTF-8 JSON ``{"code", "where", "detail"}`` (words about the
client's own schema, never the device's internals), so the gateway can name it.
"""

from __future__ import annotations

import json
import logging
import threading

import orjson

from ..engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, Matcher
from ..wire import Constraint, GrammarKind, Reason
from .errors import DeviceError
from .loading import LoadedModel

log = logging.getLogger("aotx.device")

_lock = threading.Lock()  # one compiler built per model, even by two threads at once


def compiler_of(model: LoadedModel) -> GrammarCompiler:
    with _lock:
        if model.grammars is None:
            model.grammars = model.engine.grammar_compiler()
        return model.grammars


def constraint_matcher(model: LoadedModel, constraint: Constraint | None) -> Matcher | None:
    """A fresh matcher for ``constraint`` (None without one); 400 GRAMMAR when refused."""
    if constraint is None:
        return None
    try:
        spec = _spec(constraint)
        return compiler_of(model).matcher(spec)
    except GrammarError as exc:
        log.debug("event=request.grammar_refused code=%s where=%s", exc.code, exc.where)
        raise DeviceError(400, Reason.GRAMMAR, payload=orjson.dumps(
            {"code": exc.code, "where": exc.where, "detail": exc.detail})) from None


def _spec(constraint: Constraint) -> GrammarSpec:
    if constraint.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.text)
        except ValueError:
            raise GrammarError("invalid", "the schema is not JSON") from None
        return GrammarSpec.json_schema(schema)
    if constraint.kind is GrammarKind.LARK:
        return GrammarSpec.lark(constraint.text)
    return GrammarSpec.regex(constraint.text)
