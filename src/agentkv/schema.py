"""The JSON types and schema checks that tool calls are judged by. Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator, validators

__all__ = ["TYPE_NAMES", "Schema", "json_object", "json_type", "validate"]

#: A tool's ``input_schema``: a JSON Schema object, or a boolean schema.
Schema = Mapping[str, Any] | bool

#: The type names JSON Schema knows.
TYPE_NAMES = ("null", "boolean", "integer", "number", "string", "array", "object")


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value (``integer`` for whole numbers, as JSON Schema says)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def json_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object (blank means ``{}``), or None when it is not one (NaN and
    infinities included: a client's JSON parser would reject them)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def validate(instance: Any, schema: Schema, path: str = "$") -> list[str]:
    r"""Errors of ``instance`` against a tool ``input_schema`` (empty when it is valid).

    The schema is applied by ``jsonschema`` with the draft it names (2020-12 when it names none);
    local ``$ref``\ s are followed, ``format`` is not asserted. Each error starts with the path of
    the offending value (``$.todos[0].status``). A schema that cannot be applied (it is itself
    invalid, or refers to a document it does not hold) checks nothing, as ``{}`` would: a
    client's broken schema must not fail its request.
    """
    if not isinstance(schema, Mapping | bool):
        return []
    try:
        cls = validators.validator_for(schema, default=Draft202012Validator)
        found = list(cls(schema).iter_errors(instance))
    except Exception:
        return []
    found.sort(key=lambda e: (tuple(str(p) for p in e.absolute_path), e.message))
    return [f"{path}{e.json_path[1:]}: {e.message}" for e in found]
