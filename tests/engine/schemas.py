"""JSON schemas of the kinds users send for structured output, for the structured-output tests:
nested objects, arrays, enums, anyOf, bounded numbers, string patterns and lengths, required and
optional properties, $ref definitions. Each comes with a prompt that asks for it."""

from __future__ import annotations

from typing import Any

_BASE: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}),
    ("a city and its country", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                                  "country": {"type": "string", "maxLength": 40}},
                                "required": ["city", "country"], "additionalProperties": False}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                            "required": ["answer"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "C"}},
        "required": ["celsius", "unit"]}),
    ("a list of three colours", {"type": "object", "properties": {
        "colours": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 3, "maxItems": 3}},
        "required": ["colours"]}),
    ("a product with a price", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 60}, "price": {"type": "number", "exclusiveMinimum": 0},
        "in_stock": {"type": "boolean"}}, "required": ["name", "price", "in_stock"], "additionalProperties": False}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}},
                "required": ["date"]}),
    ("a phone number", {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": r"^\+?[0-9]{7,12}$"}}, "required": ["phone"]}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 80}, "author": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030}}, "required": ["title", "author", "year"]}),
    ("an address", {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 60}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "city": {"type": "string", "maxLength": 40}}, "required": ["street", "zip", "city"]}),
    ("a user with a nested address", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("a sentiment label", {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}},
        "required": ["label", "score"]}),
    ("an id that is a number or a string", {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 12}]}},
        "required": ["id"]}),
    ("a list of people", {"type": "object", "properties": {"people": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}}}, "required": ["people"]}),
    ("a recipe", {"type": "object", "properties": {
        "dish": {"type": "string", "maxLength": 40},
        "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600}},
        "required": ["dish", "ingredients", "minutes"], "additionalProperties": False}),
    ("a shape", {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}},
         "required": ["kind", "side"], "additionalProperties": False}]}}, "required": ["shape"]}),
    ("an optional nickname", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "nickname": {"type": "string", "maxLength": 20}},
        "required": ["name"], "additionalProperties": False}),
    ("a rating from 1 to 5", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1,
                                                                         "maximum": 5}},
                              "required": ["stars"], "additionalProperties": False}),
    ("a list of integers", {"type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100},
                            "minItems": 1, "maxItems": 6}),
    ("an e-mail address", {"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,15}\\.(com|org|net)$"}},
        "required": ["email"]}),
    ("a tree node with children", {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": 0, "maximum": 99},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}}},
        "required": ["value", "children"], "additionalProperties": False},
        "leaf": {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["value"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}),
    ("a flag", {"type": "boolean"}),
    ("a number between 0 and 10", {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25}),
    ("a colour", {"enum": ["red", "green", "blue"]}),
    ("a nullable middle name", {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 30}, "middle": {"type": ["string", "null"], "maxLength": 30}},
        "required": ["first", "middle"], "additionalProperties": False}),
]


def schemas() -> list[tuple[str, dict[str, Any]]]:
    """(what to ask for, schema): the base schemas, and each again with every object closed to
    extra properties and strings of at most 16 characters where no pattern is set: 50 in all.

    Numbers carry a precision (multipleOf) where the answer is a bare number: the JSON grammar
    allows any number of digits, and SmolLM2 at temperature 0 writes "1.1111..." until max_tokens.
    Strings are limited in characters, not tokens: an emoji takes up to four, hence max_tokens 400."""
    closed = [(f"{what}, briefly", _tightened(schema)) for what, schema in _BASE]
    return _BASE + closed


def _tightened(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_tightened(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _tightened(value) for key, value in schema.items()}
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    if out.get("type") == "string" and "pattern" not in out:
        out["maxLength"] = min(out.get("maxLength", 16), 16)
    return out
