"""Clients' JSON schemas, checked before they reach the control plane: `response_format`,
`guided_json`, `structured_outputs.json` and tools' `parameters` all come through
`schema_text`, whose 400 names the place in the schema (`guided_json.properties.age.type`).

The check covers the keywords a grammar is built from; what passes it may still be refused by
the control plane's grammar compiler, which names what it cannot build.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import bad_request
from pagedserve.json_values import check_json_value

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
MAX_SCHEMA_DEPTH = 64

# Keywords whose value is a schema, a map of schemas, a list of schemas.
_SCHEMA_VALUED = (
    "additionalProperties",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_COUNTS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_NUMBERS = ("minimum", "maximum")
_STRINGS = ("pattern", "format", "$ref", "$id", "$schema", "$anchor", "title", "description")


class SchemaError(ValueError):
    """A client's JSON schema that is not one; `path` is where, in dotted form."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _pointer(root: Any, ref: str) -> bool:
    """Whether a local reference (`#`, `#/a/b`) names something in root."""
    node = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def check_schema(schema: Any, path: str) -> None:
    """Raises SchemaError where `schema` breaks JSON Schema's rules for the keywords a grammar
    is built from (types, properties, items, combinators, bounds, local `$ref`s). Unknown
    keywords pass, as JSON Schema allows; what the control plane cannot compile it names."""
    if not isinstance(schema, dict):
        raise SchemaError(path, "a JSON schema must be a JSON object")
    _check(schema, schema, path, 0)


def _check(node: Any, root: dict[str, Any], path: str, depth: int) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise SchemaError(path, "a schema must be an object or a boolean")
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(path, f"schemas nest at most {MAX_SCHEMA_DEPTH} levels deep")

    def bad(key: str, message: str) -> SchemaError:
        return SchemaError(f"{path}.{key}", message)

    if "type" in node:
        t = node["type"]
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(x, str) and x in JSON_TYPES for x in names):
            raise bad("type", f"must be one of {sorted(JSON_TYPES)} or a list of them")
        if len(set(names)) != len(names):
            raise bad("type", "must not repeat a type")
    for key in _SCHEMA_VALUED:
        if key in node:
            _check(node[key], root, f"{path}.{key}", depth + 1)
    if "items" in node:
        items = node["items"]
        if isinstance(items, list):  # drafts 4 to 7: one schema per position
            for i, sub in enumerate(items):
                _check(sub, root, f"{path}.items.{i}", depth + 1)
        else:
            _check(items, root, f"{path}.items", depth + 1)
    for key in _SCHEMA_MAPS:
        if key in node:
            value = node[key]
            if not isinstance(value, dict):
                raise bad(key, "must be an object of schemas")
            for name, sub in value.items():
                _check(sub, root, f"{path}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in node:
            value = node[key]
            if not isinstance(value, list) or not value:
                raise bad(key, "must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                _check(sub, root, f"{path}.{key}.{i}", depth + 1)
    if "required" in node:
        req = node["required"]
        if not isinstance(req, list) or not all(isinstance(x, str) for x in req):
            raise bad("required", "must be a list of property names")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise bad("enum", "must be a non-empty list")
    for key in _COUNTS:
        if key in node and not _is_count(node[key]):
            raise bad(key, "must be a non-negative integer")
    for key in _NUMBERS:
        if key in node and not _is_number(node[key]):
            raise bad(key, "must be a number")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):  # a boolean in draft 4
        if key in node and not (_is_number(node[key]) or isinstance(node[key], bool)):
            raise bad(key, "must be a number")
    if "multipleOf" in node and not (_is_number(node["multipleOf"]) and node["multipleOf"] > 0):
        raise bad("multipleOf", "must be a number above 0")
    if "uniqueItems" in node and not isinstance(node["uniqueItems"], bool):
        raise bad("uniqueItems", "must be a boolean")
    for key in _STRINGS:
        if key in node and not isinstance(node[key], str):
            raise bad(key, "must be a string")
    for low, high in (
        ("minItems", "maxItems"),
        ("minLength", "maxLength"),
        ("minProperties", "maxProperties"),
        ("minimum", "maximum"),
    ):
        if low in node and high in node and node[low] > node[high]:
            raise bad(low, f"must not exceed {high}")
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not _pointer(root, ref):
        raise bad("$ref", f"{ref!r} names nothing in the schema")


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s (`#...`) still name the same parts once it sits
    at JSON pointer `base` ("#/items/...") inside another document."""
    if isinstance(schema, list):
        return [rebase_refs(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(
            value, dict
        ):  # property names, not keywords: a property called "$ref" stays as it is
            out[key] = {k: rebase_refs(v, base) for k, v in value.items()}
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value  # data, not schemas
        else:
            out[key] = rebase_refs(value, base)
    return out


def compact_json(value: Any) -> str:
    """`value` as the control plane takes a schema: compact JSON, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def schema_text(schema: Any, param: str) -> str:
    """A client's JSON schema (an object, or a string holding one), checked, as compact JSON;
    a 400 naming `param` (and the place in the schema) when it is none."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
            check_json_value(schema)
        except RecursionError:
            raise bad_request(f"{param}: JSON nested too deeply", param) from None
        except ValueError as exc:
            raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
    try:
        check_schema(schema, param)
    except SchemaError as exc:
        raise bad_request(f"{exc.path}: {exc.message}", param) from None
    return compact_json(schema)
