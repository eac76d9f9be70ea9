"""Limits on parsed JSON values from clients (request bodies, schemas and tool-call arguments
sent as strings)."""

from __future__ import annotations

from typing import Any

# How deep a client's JSON may nest.
MAX_JSON_DEPTH = 128


def check_json_value(value: Any) -> None:
    """A parsed JSON value's strings must be valid Unicode (no lone surrogates, which no
    UTF-8 encoder takes) and its arrays and objects nested at most MAX_JSON_DEPTH deep (what
    later reads it recursively, a schema check or an encoder, stays far from Python's
    recursion limit). Walked without recursion; raises ValueError."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
        elif isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
