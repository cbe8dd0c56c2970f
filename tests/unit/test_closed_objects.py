"""Object schemas that list their properties take no others (gateway/closed_objects.py)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from aotx.gateway.closed_objects import close_objects

CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"]}


def test_an_object_that_lists_its_properties_takes_no_others() -> None:
    closed = close_objects(CITY)
    assert closed == {**CITY, "additionalProperties": False}
    assert CITY.get("additionalProperties") is None  # the caller's schema is not changed
    jsonschema.validate({"city": "Paris"}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "temperature": 25}, closed)


@pytest.mark.parametrize("where,inner", [
    (lambda s: {"type": "object", "properties": {"place": s}}, lambda o: o["properties"]["place"]),
    (lambda s: {"type": "array", "items": s}, lambda o: o["items"]),
    (lambda s: {"type": "array", "prefixItems": [s]}, lambda o: o["prefixItems"][0]),
    (lambda s: {"anyOf": [s, {"type": "null"}]}, lambda o: o["anyOf"][0]),
    (lambda s: {"$defs": {"c": s}, "$ref": "#/$defs/c"}, lambda o: o["$defs"]["c"]),
    (lambda s: {"type": "object", "additionalProperties": s},
     lambda o: o["additionalProperties"]),
])
def test_nested_object_schemas_are_closed(where: Any, inner: Any) -> None:
    assert inner(close_objects(where(CITY))) == {**CITY, "additionalProperties": False}


@pytest.mark.parametrize("schema", [
    {**CITY, "additionalProperties": True},
    {**CITY, "additionalProperties": {"type": "integer"}},
    {**CITY, "patternProperties": {"^x-": {"type": "string"}}},
    {**CITY, "unevaluatedProperties": False},
    {**CITY, "allOf": [{"properties": {"zip": {"type": "string"}}}]},
    {**CITY, "$ref": "#/$defs/x", "$defs": {"x": {"type": "object"}}},
    {**CITY, "required": ["city", "country"]},  # requires one it does not list
    {"type": "object"},  # lists none: any object
])
def test_what_says_otherwise_stays_open(schema: dict[str, Any]) -> None:
    assert close_objects(schema).get("additionalProperties") == schema.get(
        "additionalProperties")


def test_an_all_of_branch_is_never_closed() -> None:
    """llguidance merges allOf's branches with each side's additionalProperties: a closed
    branch would refuse the other branch's properties."""
    schema = {"allOf": [CITY, {"properties": {"zip": {"type": "string"}}}]}
    out = close_objects(schema)
    assert all("additionalProperties" not in b for b in out["allOf"])
    jsonschema.validate({"city": "Paris", "zip": "75001"}, out)


def test_a_property_named_like_a_keyword_is_a_property() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object"},
                                               "items": {"type": "string"}}}
    out = close_objects(schema)
    assert out["properties"] == schema["properties"]  # the map itself is not a schema
    assert out["additionalProperties"] is False
    assert close_objects(True) is True and close_objects([CITY]) == [CITY]
