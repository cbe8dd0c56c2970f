"""A JSON schema as the device enforces it: an object whose schema lists its
``properties`` takes only those, unless the schema says otherwise.

JSON Schema allows any other property where ``additionalProperties`` is not given, and
llguidance enforces exactly that, so a small model invents keys (``{"city": "Paris",
"temperature": 25}`` for a schema of ``city`` alone) and callers that pass the arguments
on as keywords break.  llama.cpp's server and vLLM's default (xgrammar's strict mode)
both read a missing ``additionalProperties`` as false, and OpenAI's strict mode requires
it to be false; aotx does as the first two, for ``response_format`` schemas and tools'
``parameters``, strict or not.  What the model is shown (the template's tool list) is
the schema as sent.

Closing is only sound where no schema is merged with another: llguidance intersects
``allOf`` branches, and a schema with the keywords beside an applicator (``anyOf``,
``oneOf``, ``$ref``), merging each side's properties under the other side's
``additionalProperties``; a closed side would refuse the other side's properties
(OpenAPI's ``allOf: [{"$ref": base}, {extension}]``, ``properties`` beside ``anyOf``);
``if``/``then``/``else``, ``not``, ``dependentSchemas`` and the ``unevaluated*``
keywords apply subschemas to the same object too.  So a schema that merges anywhere
(one of those, or ``anyOf``, ``oneOf`` or ``$ref`` with constraints beside it;
annotations such as ``description``, and ``type``, do not count) is left as written,
whole.  In the
rest, an object schema is closed when it lists ``properties``, says nothing of the
others (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``) and
requires none beyond them.  Sans-I/O: dict in, dict out.
"""

from __future__ import annotations

from typing import Any

#: Keywords whose value is one subschema, a list of them, or a map of them.
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_MERGING = ("allOf", "if", "not", "dependentSchemas", "unevaluatedProperties",
            "unevaluatedItems")
_APPLICATORS = ("anyOf", "oneOf", "$ref")
#: Keywords that constrain nothing (and ``type``, which merges without properties).
_BESIDE = frozenset(("title", "description", "default", "examples", "deprecated",
                     "readOnly", "writeOnly", "$comment", "$id", "$schema", "$anchor",
                     "$defs", "definitions", "x-guidance", "type", "nullable"))
#: Deeper than the device takes (it refuses over 32 levels): left for it to refuse.
MAX_DEPTH = 64


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` with its object schemas closed (the module's rule), or
    ``schema`` itself where it merges, is deeper than :data:`MAX_DEPTH`, or is not a
    schema (the device says what is wrong with it)."""
    return _closed(schema, 0) if _simple(schema, 0) else schema


def _subschemas(node: dict[str, Any]) -> list[Any]:
    out = [node[k] for k in _ONE if isinstance(node.get(k), dict)]
    out += [s for k in _LIST if isinstance(node.get(k), list) for s in node[k]]
    out += [s for k in _MAP if isinstance(node.get(k), dict) for s in node[k].values()]
    return out


def _simple(node: Any, depth: int) -> bool:
    """No schema in ``node`` merges with another (the module's rule), within the depth."""
    if not isinstance(node, dict):
        return True
    if depth > MAX_DEPTH or any(k in node for k in _MERGING):
        return False
    if any(k in node for k in _APPLICATORS) and any(
            k not in _BESIDE and k not in _APPLICATORS for k in node):
        return False
    return all(_simple(s, depth + 1) for s in _subschemas(node))


def _closed(node: Any, depth: int) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], depth + 1)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, depth + 1) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s, depth + 1) for name, s in out[key].items()}
    props, required = out.get("properties"), out.get("required", [])
    if (isinstance(props, dict) and not any(k in out for k in _OPEN)
            and isinstance(required, list)
            and all(isinstance(n, str) and n in props for n in required)):
        out["additionalProperties"] = False
    return out
