"""A request's `response_format`, OpenAI's shape, as the grammar its reply follows.

Owns: reading {"type": "text"} (free text), {"type": "json_object"} (any JSON object) and
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} into
the engine's grammar (chatcli.engine.grammar), refusing any other shape with a message that
names the field, and a schema the grammar library cannot enforce with one that names the
keyword. Knows nothing of HTTP or workers.
"""

from __future__ import annotations

from typing import Any

from chatcli.engine.grammar import json_grammar

FORMATS = ("text", "json_object", "json_schema")
# OpenAI's rule for a schema's name.
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME = 64


def response_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar a reply asked for in `response_format` must follow; None for free text.
    A ValueError says what is wrong with the shape; a SchemaError (from the grammar library,
    or its absence) what the schema asks that cannot be enforced."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in FORMATS:
        raise ValueError(
            f"type {kind!r} is not one chatcli serves: use "
            '"text", "json_object" or "json_schema" (OpenAI\'s shapes)'
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or set(name) - NAME_CHARS:
        raise ValueError(
            f"json_schema.name must be 1 to {MAX_NAME} letters, digits, _ or -, not {name!r}"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):  # 0 == False: not a bool here
        raise ValueError("json_schema.strict must be true or false")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError("json_schema.description must be a string")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError("json_schema.schema must be a JSON Schema object")
    # strict or not, the reply follows the schema: the grammar enforces it either way.
    return json_grammar(schema)
