"""What a request body's validation errors say to the caller: one message and one
``param``, in the field names the caller wrote.

Pydantic reports a value that fits none of a union's members once per member, and puts
the member's label into the location (``messages.0.content.str``,
``tool_choice.literal['none','auto','required']``, ``input.list[str].0``): names the caller
never wrote.  :func:`explain` walks the location along the body's model and drops those
labels, picks the error deepest in the body (the member that matched the most of the
value: ``content.0.text`` over ``content``), and when several members fail at one place
says what each would have taken (``Input should be a string or an array, not an
integer``), as OpenAI does (``expected one of a string or array of objects``).  Sans-I/O:
no request, no framework.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Tag

#: A type error's expected kind, for a union's combined message.
_KINDS = {"string_type": "a string", "list_type": "an array", "int_type": "an integer",
          "float_type": "a number", "bool_type": "a boolean", "dict_type": "an object",
          "model_type": "an object", "model_attributes_type": "an object",
          "none_required": "null"}
_SCALARS = {str: "str", int: "int", float: "float", bool: "bool", bytes: "bytes"}
_SEQUENCES = (list, tuple, Sequence, typing.Sequence)


def explain(model: type[BaseModel] | None, errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) for pydantic's ``errors`` of ``model`` (FastAPI's, whose locations
    start with ``body``, ``query``, ``path`` or ``header``, or a model's own)."""
    located = [(*_path(model, e), e) for e in errors]
    if not located:
        return "invalid request", None
    depth = max(len(at) for at, _, _ in located)
    at, t = next((at, t) for at, t, _ in located if len(at) == depth)
    param = ".".join(str(x) for x in at) or None
    message = _message([e for where, _, e in located if where == at], t)
    return (f"{param}: {message}" if param else message), param


def _path(model: type[BaseModel] | None, error: Any) -> tuple[tuple[str | int, ...], Any]:
    """The error's location without member labels, and the type found there."""
    loc = tuple(error.get("loc", ()))
    if loc[:1] in (("body",), ("query",), ("path",), ("header",)):
        if loc[0] != "body":
            return loc[1:], None  # a query or path parameter: its own name
        loc = loc[1:]
    out: list[str | int] = []
    t: Any = model
    for el in loc:
        members = _members(t)
        if members is not None and isinstance(el, str):
            member = next((m for m in members if _labelled(m, el)), None)
            if member is not None:  # a member's label: not a field the caller wrote
                t = member
                continue
        out.append(el)
        t = _child(t, el)
    return tuple(out), t


def _bare(t: Any) -> Any:
    while get_origin(t) is Annotated:
        t = get_args(t)[0]
    return t


def _members(t: Any) -> list[Any] | None:
    """A union's members other than None (pydantic labels no nullable), or None."""
    t = _bare(t)
    if get_origin(t) not in (Union, types.UnionType):
        return None
    members = [m for m in get_args(t) if m is not type(None)]
    return members if len(members) > 1 else None


def _labelled(member: Any, label: str) -> bool:
    """Whether pydantic's ``label`` for a union member names ``member``: its ``Tag``, its
    class name or discriminating ``type`` value, or the kind of its core schema."""
    tags = [m.tag for m in get_args(member)[1:] if isinstance(m, Tag)] \
        if get_origin(member) is Annotated else []
    base = _bare(member)
    if label in tags:
        return True
    if isinstance(base, type) and issubclass(base, BaseModel):
        kind = base.model_fields.get("type")
        return label == base.__name__ or (kind is not None
                                          and label in _literals(kind.annotation))
    origin = get_origin(base)
    if origin is Literal:
        return label.startswith("literal[")
    if origin in _SEQUENCES:
        return label.startswith(("list[", "tuple["))
    if origin is dict:
        return label.startswith("dict[")
    name = _SCALARS.get(base)
    return name is not None and label in (name, f"constrained-{name}")


def _child(t: Any, el: str | int) -> Any:
    """The type at ``el`` inside ``t`` (None where the walk cannot follow)."""
    t = _bare(t)
    if isinstance(t, type) and issubclass(t, BaseModel) and isinstance(el, str):
        for name, field in t.model_fields.items():
            if (field.alias or name) == el:
                return field.annotation
        return None
    args = get_args(t)
    if get_origin(t) in _SEQUENCES and isinstance(el, int) and args:
        return args[0]
    if get_origin(t) is dict and len(args) == 2:
        return args[1]
    return None


def _message(errors: list[Any], t: Any) -> str:
    """One place's message (``t``: the type there): a member's own error where the value
    had its type, else what each member would have taken."""
    if len(errors) > 1 and all(e.get("type") in _KINDS or e.get("type") == "literal_error"
                               for e in errors):
        kinds = [_kind(e) for e in errors]
        return f"Input should be {_either(kinds)}, not {_what(errors[0].get('input'))}"
    e = next((e for e in errors if e.get("type") not in _KINDS), errors[0])
    if e.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        # The discriminator's tags can be internal (a native digest part and OpenAI's
        # inline audio share one "type"): name the "type" values the members take.
        sent = e.get("input")
        kind = sent.get("type") if isinstance(sent, dict) else None
        said = "the object needs a \"type\"" if kind is None else \
            f"unknown type {json.dumps(kind)[:60]}"
        expected = _type_values(t)
        return f"{said}; expected one of {expected}" if expected else said
    return str(e.get("msg", "invalid value"))


def _type_values(t: Any) -> str:
    """The ``type`` values a union of models takes, quoted, in the members' order."""
    values: list[str] = []
    for member in _members(t) or ():
        base = _bare(member)
        kind = base.model_fields.get("type") if isinstance(base, type) and issubclass(
            base, BaseModel) else None
        if kind is not None:
            values += [json.dumps(v) for v in _literals(kind.annotation)]
    return ", ".join(dict.fromkeys(values))


def _literals(t: Any) -> tuple[Any, ...]:
    """A Literal's values, also inside an Optional."""
    t = _bare(t)
    if get_origin(t) is Literal:
        return get_args(t)
    if get_origin(t) in (Union, types.UnionType):
        return tuple(v for m in get_args(t) for v in _literals(m))
    return ()


def _kind(error: Any) -> str:
    if error.get("type") == "literal_error":
        return str((error.get("ctx") or {}).get("expected", "")).replace(" or ", ", ")
    return _KINDS[error["type"]]


def _either(kinds: list[str]) -> str:
    kinds = list(dict.fromkeys(kinds))
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def _what(value: Any) -> str:
    """The value sent: a string by its first characters, else its JSON kind."""
    return json.dumps(value[:40]) if isinstance(value, str) else kind_of(value)


def kind_of(value: Any) -> str:
    """A decoded JSON value's kind, with its article."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"
