"""JSON Schemas and tools for the constrained-decoding tests, and checks of their outputs.

Every string is bounded (maxLength, enum, pattern or format) and every number has a range:
a model with random weights rarely chooses to end a free string or a number, and the tests
need most answers to finish within a small max_output_tokens.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

NAME = {"type": "string", "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": SMALL_INT},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue"]},
    "integer_enum": {"enum": [1, 2, 3, 5, 8]},
    "booleans_and_null": {
        "type": "object",
        "properties": {"flag": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["flag", "nothing"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"id": SMALL_INT, "note": NAME, "done": {"type": "boolean"}},
        "required": ["id"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "values": {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 3}
        },
        "required": ["values"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "array",
        "items": {"enum": ["a", "b", "c"]},
        "minItems": 0,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "deeply_nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": SMALL_INT},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "any_of_scalars": {
        "type": "object",
        "properties": {"value": {"anyOf": [NAME, SMALL_INT]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "any_of_objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "radius": SMALL_INT},
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": SMALL_INT},
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    "nullable": {
        "type": "object",
        "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["middle_name"],
        "additionalProperties": False,
    },
    "nullable_object": {
        "type": "object",
        "properties": {
            "address": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"],
                        "additionalProperties": False,
                    },
                    {"type": "null"},
                ]
            }
        },
        "required": ["address"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
        "additionalProperties": False,
    },
    "refs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL_INT, "y": SMALL_INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"enum": ["x1", "y2"]}, "qty": SMALL_INT},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "bounded_number": {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
        "required": ["ratio"],
        "additionalProperties": False,
    },
    "tuple": {
        "type": "array",
        "prefixItems": [NAME, SMALL_INT, {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    },
    "all_of": {
        "type": "object",
        "properties": {"a": True, "b": True},
        "additionalProperties": False,
        "allOf": [
            {"properties": {"a": SMALL_INT}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ],
    },
    "date": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "fixed_pair": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    "mixed": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", None]},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
            "owner": {"anyOf": [{"type": "null"}, NAME]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["status", "tags", "owner", "priority"],
        "additionalProperties": False,
    },
}

# Function tools with bounded arguments (see the module docstring). `strict` varies.
TOOL_PARAMETERS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "add": {
        "type": "object",
        "properties": {"a": SMALL_INT, "b": SMALL_INT},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "set_flag": {
        "type": "object",
        "properties": {"name": NAME, "on": {"type": "boolean"}},
        "required": ["name", "on"],
        "additionalProperties": False,
    },
    "no_arguments": {"type": "object", "properties": {}, "additionalProperties": False},
}


def tools(*, strict: bool) -> list[dict[str, Any]]:
    return [
        {"type": "function", "name": name, "description": f"The {name} tool.",
         "parameters": parameters, "strict": strict}
        for name, parameters in TOOL_PARAMETERS.items()
    ]  # fmt: skip


def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def assert_valid_json(text: str, schema: dict[str, Any]) -> None:
    """``text`` parses as JSON and validates against ``schema`` (formats checked too)."""
    validator(schema).validate(json.loads(text))
