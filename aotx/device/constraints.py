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
import re
import threading

import orjson

from ..engine.closing import Closing
from ..engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, Matcher
from ..wire import (
    CHANNEL_NEXT,
    STATE_FLAG_THINK_OPEN,
    STATE_FLAG_THINKS,
    THINK_TAGS,
    Constraint,
    GrammarKind,
    Reason,
    think_tags,
)
from .errors import DeviceError
from .loading import LoadedModel

log = logging.getLogger("aotx.device")

_lock = threading.Lock()  # one compiler built per model, even by two threads at once


def compiler_of(model: LoadedModel) -> GrammarCompiler:
    with _lock:
        if model.grammars is None:
            model.grammars = model.engine.grammar_compiler()
        return model.grammars


def constraint_matcher(model: LoadedModel, constraint: Constraint | None, thinking: int = 0,
                       budget: int = 0, asked: int = 0, channel: bool = False
                       ) -> Matcher | None:
    """A fresh matcher for ``constraint`` (None without one); 400 GRAMMAR when refused.
    ``thinking``: the request's STATE_FLAG_THINKS bits: the constraint applies after the
    model's think block, which has at most ``budget`` tokens, or ``asked`` (the request's
    thinking budget), which bounds the think block of a request without a constraint too.
    ``channel``: gpt-oss's tool calls, whose grammar names the channel that follows the
    analysis one, ``final`` or ``commentary`` (gateway/tools.py)."""
    if asked and thinking & STATE_FLAG_THINKS:
        budget = asked
        constraint = constraint or Constraint(GrammarKind.LARK, "start: /(.|\\n)*/\n")
    if constraint is None:
        return None
    try:
        thinks = bool(thinking & STATE_FLAG_THINKS) and constraint.kind is not GrammarKind.REGEX
        opened, tags = bool(thinking & STATE_FLAG_THINK_OPEN), think_tags(thinking)
        if channel:
            tags = (tags[0], CHANNEL_NEXT)
        compiler = compiler_of(model)
        forcing = thinks and not model.engine.applies_grammar  # (engine/closing.py)
        if thinks:
            # an engine that applies the grammar itself keeps llguidance's budget (``stop``)
            # for a closing of one token only: with more, llguidance fails on it
            stop = not forcing and len(compiler.tokenizer.tokenize_bytes(tags[1].encode())) == 1
            constraint = after_thinking(constraint, opened, budget, tags, gap=not channel,
                                        stop=stop)
        matcher = compiler.matcher(_spec(constraint))
        if forcing:
            matcher.closing = Closing(tags[1].encode(), budget,
                                      compiler.tokenizer.tokenize_bytes,
                                      model.engine.token_bytes,
                                      b"" if opened else tags[0].encode())
        return matcher
    except GrammarError as exc:
        log.debug("event=request.grammar_refused code=%s where=%s", exc.code, exc.where)
        raise DeviceError(400, Reason.GRAMMAR, payload=orjson.dumps(
            {"code": exc.code, "where": exc.where, "detail": exc.detail})) from None


def after_thinking(constraint: Constraint, opened: bool, budget: int,
                   tags: tuple[str, str] = THINK_TAGS, gap: bool = True,
                   stop: bool = False) -> Constraint:
    """``constraint`` after a think block: ``<think>`` (unless the prompt opened it), free
    text of at most ``budget`` tokens, ``</think>`` (the model writes it when it is done,
    or must once the budget is spent), at most four blanks, and the constraint's grammar
    as the answer.  ``tags``: the block's opening and closing (gpt-oss's: its analysis
    channel, then the final one).

    The thought is a lazy lexeme that ends with ``</think>`` (its ``suffix``): a greedy
    one that merely excludes the tag cannot end where the tag begins, since llguidance's
    lexer does not go back over the tag's first bytes, and the model could close the
    block only once the budget forced it.  The budget is the matcher's
    (engine/closing.py): the lexeme's own ``max_tokens`` would end it without the tag.

    With ``stop`` (an engine that applies the grammar itself, vLLM, and a closing of one
    token) the lexeme stops at the tag (``stop``, then the tag again as text) within
    ``max_tokens``, which llguidance closes.  With a closing of several tokens that form
    panics in llguidance 1.9.1 once the model has written the tag up to its last token
    (engine/closing.py), so such an engine gets the ``suffix`` form and no budget.

    The blanks are bounded because a model may write newline after newline there
    (SmolLM2 after gpt-oss's final channel) until ``max_tokens``, with no answer.
    Without ``gap`` the answer follows the closing at once (gpt-oss's tool calls: the
    closing ends at ``<|channel|>``, and the answer names the channel)."""
    if constraint.kind is GrammarKind.JSON_SCHEMA:
        answer = f"answer: %json {constraint.text}"
    else:  # a Lark grammar: its start rule becomes the answer
        answer = _START.sub("answer:", constraint.text)
    head = "" if opened else json.dumps(tags[0]) + " "
    tag = json.dumps(tags[1])
    thought, rule = ((f"thought[stop={tag}, max_tokens={budget}]", f"thought {tag}") if stop
                     else (f"thought[suffix={tag}]", "thought"))
    return Constraint(GrammarKind.LARK, (
        f"start: {head}{rule}{' GAP' * gap} answer\n"
        f"{thought}: /(.|\\n)*/\n"
        + "GAP: /[ \\t\\n]{0,4}/\n" * gap) + answer + "\n")


_START = re.compile(r"^start\s*:", re.MULTILINE)


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
