"""One table per layout: a field's row (:class:`F`) rides on its annotation, and the
``struct`` of a record (:func:`layout`) and its table in docs/protocol.md (:func:`rows`)
come from those rows."""

from __future__ import annotations

import struct
from typing import Any, Generic, NamedTuple, TypeVar, get_type_hints

T = TypeVar("T")


class F(NamedTuple):
    """One field's row of a layout table, carried by its annotation: a layout is described
    once, and its ``struct``, its codec and its table in docs/protocol.md come from it."""

    fmt: str  #: struct format character(s)
    offset: int
    seed: bool  #: the seed fixes this offset
    meaning: str


class _View(Generic[T]):
    """A named accessor: one meaning of a field that means different things per operation
    (``when`` says which; the header table in docs/protocol.md lists them)."""

    def __init__(self, field: str, when: str) -> None:
        self.field, self.when = field, when

    def __get__(self, header: tuple[Any, ...], owner: object = None) -> T:
        return getattr(header, self.field)



def layout(record: type[tuple[Any, ...]], size: int) -> struct.Struct:
    """The ``struct`` of a record annotated with rows (``F``): offsets checked, ``size`` bytes."""
    at = 0
    for name, row in rows(record):
        if row.offset != at:
            raise AssertionError(f"{record.__name__}.{name} is at {at}, its row says {row.offset}")
        at += struct.calcsize("<" + row.fmt)
    packed = struct.Struct("<" + "".join(row.fmt for _, row in rows(record)))
    if packed.size != size:
        raise AssertionError(f"{record.__name__} is {packed.size} bytes, not {size}")
    return packed


def rows(record: type[tuple[Any, ...]]) -> tuple[tuple[str, F], ...]:
    """(field name, its row) of a record annotated with rows, in offset order."""
    hints = get_type_hints(record, include_extras=True)
    return tuple((name, hints[name].__metadata__[0]) for name in record._fields  # type: ignore[attr-defined]
                 if hasattr(hints[name], "__metadata__"))
