"""How large a schema's ``pattern`` is once its counted repetitions are written out.

llguidance's lexer is built lazily, a state per derivative of the regex as the output
goes: ``^(x{1000}){1000}$`` compiles at once and then needs a million states, one per
``x`` written, so it passed admission and failed mid-generation (issue 39: 500
``GRAMMAR_FAILED`` after 4-7 s of a slot and of mask work).  Such a pattern is refused at
admission instead: :func:`expanded_size` counts the regex's atoms with each counted
repetition written out (``a{3}`` is 3, ``(ab){2,5}`` 10, ``a*`` 1: a star adds no
states), and a pattern over :data:`MAX_EXPANDED` is 400 ``too_complex``.  The count is
the size of the regex a lexer state may have to distinguish; a date, a UUID or
``.{0,5000}`` stay far below it.  Python's own regex parser reads the pattern (Unicode
classes and named groups respelt); one it still cannot read is counted as if all its
counted repetitions nested.
"""

from __future__ import annotations

# Python's own regex parser (3.11: re._parser; its documented name, sre_parse, is
# deprecated): the standard library's reading of the syntax JSON Schema patterns share.
import re
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as P  # type: ignore[attr-defined]
from typing import Any

#: The most atoms a pattern may have with its counted repetitions written out (the
#: lexer's state limit, GrammarLimits.max_lexer_states, is 20,000).
MAX_EXPANDED = 20_000
_REPEATS = {C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", C.MAX_REPEAT)}


#: ECMA and Rust spellings Python's parser does not take, as ones of the same size.
_SPELLINGS = ((re.compile(r"\\[pP]\{[^}]*\}"), "."), (re.compile(r"\(\?<(?=[A-Za-z_])"), "(?P<"))
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def expanded_size(pattern: str) -> int:
    """The pattern's atoms with counted repetitions written out (stops counting past
    :data:`MAX_EXPANDED`).  A pattern Python cannot parse even respelt (``\\p{L}`` as
    ``.``, ``(?<name>`` as ``(?P<name>``) counts as the product of its counted
    repetitions, as if each nested the next."""
    text = pattern
    for spelling, python in _SPELLINGS:
        text = spelling.sub(python, text)
    try:
        return _size(P.parse(text))
    except (re.error, RecursionError, OverflowError, ValueError):
        size = 1  # (a malformed pattern without counts: llguidance words its refusal)
        for low, high in _COUNT.findall(pattern):
            size *= max(1, int(high or low))
            if size > MAX_EXPANDED:
                break
        return size


def _size(items: Any) -> int:
    total = 0
    for op, av in items:
        if op in _REPEATS:
            low, high, sub = av
            count = low if high == C.MAXREPEAT else high
            total += max(1, count) * _size(sub)
        elif op is C.SUBPATTERN:
            total += _size(av[-1])
        elif op is C.BRANCH:
            total += sum(_size(b) for b in av[1])
        elif op is getattr(C, "ATOMIC_GROUP", None):
            total += _size(av)
        else:
            total += 1
        if total > MAX_EXPANDED:
            return total
    return total
