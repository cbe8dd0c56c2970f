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

Only schemas that list ``properties``, say nothing of the others
(``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``) and require
none beyond them are closed; never an ``allOf`` branch, nor a schema with ``allOf`` or ``$ref`` beside its
properties: llguidance merges those with each side's ``additionalProperties``, and a
closed side would refuse the other side's properties.  Sans-I/O: dict in, dict out.
"""

from __future__ import annotations

from typing import Any

#: Keywords whose value is one subschema, a list of them, or a map of them.
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_MERGED = ("allOf", "$ref")


def close_objects(schema: Any, closable: bool = True) -> Any:
    """A copy of ``schema`` with every object schema that lists its properties closed
    to others (the module's rule); anything that is not a schema is returned as is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, closable=False) for s in out["allOf"]]
    props = out.get("properties")
    if (closable and isinstance(props, dict) and not any(k in out for k in _OPEN + _MERGED)
            and all(name in props for name in out.get("required") or ())):
        out["additionalProperties"] = False
    return out
