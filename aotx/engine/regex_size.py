"""How large a schema's ``pattern`` is once its counted repetitions are written out.

llguidance's lexer is built lazily, a state per derivative of the regex as the output
goes: ``^(x{1000}){1000}$`` compiles at once and then needs a million states, one per
``x`` written, so it passed admission and failed mid-generation (issue 39: 500
``GRAMMAR_FAILED`` after 4-7 s of a slot and of mask work).  Such a pattern is refused at
admission instead: :func:`expanded_size` counts the regex's atoms with each counted
repetition written out (``a{3}`` is 3, ``(ab){2,5}`` 10, ``a*`` 1: a star adds no
states), and a pattern over :data:`MAX_EXPANDED` is 400 ``too_complex``.  The count is
the size of the regex a lexer state may have to distinguish; a date, a UUID or
``.{0,5000}`` stay far below it.  Python's own regex parser reads the pattern; one it
cannot read (ECMA-only syntax such as ``\\p{L}``) is left to llguidance to judge.
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


def expanded_size(pattern: str) -> int | None:
    """The pattern's atoms with counted repetitions written out (stops counting past
    :data:`MAX_EXPANDED`); None when Python cannot parse it."""
    try:
        return _size(P.parse(pattern))
    except (re.error, RecursionError, OverflowError, ValueError):
        return None


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
