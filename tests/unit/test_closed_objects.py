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


B: dict[str, Any] = {"type": "object", "properties": {"id": {"type": "integer"}}}


@pytest.mark.parametrize("schema,instance", [
    # OpenAPI's inheritance, and a $ref beside properties
    ({"$defs": {"B": B}, "allOf": [{"$ref": "#/$defs/B"},
                                   {"properties": {"name": {"type": "string"}}}]},
     {"id": 1, "name": "x"}),
    ({"$defs": {"B": B}, "$ref": "#/$defs/B", "properties": {"name": {"type": "string"}}},
     {"id": 1, "name": "x"}),
    # properties beside anyOf: the branches add to them
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "anyOf": [{"properties": {"kind": {"const": "x"}, "x": {"type": "integer"}}}]},
     {"kind": "x", "x": 1}),
    ({"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["b"]}]},
     {"a": 1, "b": 2}),
    # objects in two allOf branches merge, at any depth
    ({"allOf": [{"properties": {"o": {"properties": {"a": {}}}}},
                {"properties": {"o": {"properties": {"b": {}}}}}]}, {"o": {"a": 1, "b": 2}}),
    ({"allOf": [{"anyOf": [{"properties": {"a": {}}}]}, {"properties": {"b": {}}}]},
     {"a": 1, "b": 2}),
    # if/then applies to the same object
    ({"type": "object", "if": {"properties": {"k": {"const": 1}}},
      "then": {"properties": {"x": {}}}}, {"k": 1, "x": 2}),
])
def test_a_schema_that_merges_is_left_as_written(schema: dict[str, Any],
                                                  instance: dict[str, Any]) -> None:
    """Closing a side of a merge would refuse the other side's properties (the review of
    the first version: each of these was refused by llguidance once closed)."""
    jsonschema.validate(instance, schema)
    assert close_objects(schema) == schema
    jsonschema.validate(instance, close_objects(schema))


@pytest.mark.parametrize("schema", [
    {**CITY, "required": 5}, {**CITY, "required": [["city"]]}, {**CITY, "required": True},
    {"type": "object", "properties": [1, 2]}, {"anyOf": "x"}, {"items": [None, 3]},
])
def test_a_malformed_schema_is_the_device_s_to_refuse(schema: dict[str, Any]) -> None:
    """No exception here (it would be a 500 before the token on the fast paths): the
    device answers what is wrong with it (400 invalid_schema)."""
    close_objects(schema)


def test_a_deep_schema_is_left_to_the_device() -> None:
    deep: dict[str, Any] = CITY
    for _ in range(5000):  # far past Python's recursion limit
        deep = {"type": "array", "items": deep}
    assert close_objects(deep) is deep


def test_a_pydantic_schema_is_closed_through_its_refs() -> None:
    """What ``client.chat.completions.parse`` and pydantic send: $defs, a $ref with a
    description beside it, Optional as anyOf with null; none of these merge."""
    import pydantic

    class Place(pydantic.BaseModel):
        city: str

    class Person(pydantic.BaseModel):
        name: str
        home: Place = pydantic.Field(description="where they live")
        work: Place | None = None

    schema = Person.model_json_schema()
    out = close_objects(schema)
    assert out["additionalProperties"] is False
    assert out["$defs"]["Place"]["additionalProperties"] is False
    person = {"name": "A", "home": {"city": "B"}, "work": None}
    jsonschema.validate(person, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**person, "home": {"city": "B", "zip": 1}}, out)
