"""Constraints for structured output: JSON schemas, regexes, choice lists and EBNF grammars, each
with a valid example and a checker for what a constrained request returns.

Every constraint is bounded, so that a small model sampling at temperature 0.8 ends within
about 256 tokens: each string has a `maxLength` (<= 40) or a pattern / enum / format that bounds
it, each array a `maxItems` (<= 5), and each grammar repeats only a bounded number of times.

    SCHEMAS             [(name, schema)]          at least 32, the JSON schemas
    SCHEMA_EXAMPLES     {name: instance}          a valid instance of each, keys in schema order
    BENCHMARK_SCHEMAS   [name] * 8                schemas of 5..20 properties for benchmarks
    TWENTY_PROPERTY_SCHEMA                        a schema of exactly 20 (top-level) properties
    REGEXES             [(name, regex)]           matched whole (no ^ / $: both libraries anchor)
    REGEX_EXAMPLES      {name: text}
    CHOICES             [(name, [str, ...])]
    GRAMMARS            [(name, ebnf)]            GBNF-like (`root ::= ...`), as vLLM's
                                                  `guided_grammar` takes with xgrammar
    GRAMMAR_EXAMPLES    {name: text}
    GRAMMAR_CHECKS      {name: str -> bool}       a Python check of a grammar's output

`check_schema(schema, text)`, `check_regex`, `check_choice` and `check_grammar` say whether an
output satisfies its constraint. Schemas are checked with `jsonschema_rs` (a dependency of the
dev extra's schemathesis; formats validated), or with `jsonschema` where that is installed and
`jsonschema_rs` is not.

Formats used are those both xgrammar and llguidance enforce: date, date-time, time, email, uuid,
ipv4. Patterns carry `^...$`: JSON Schema's `pattern` is an unanchored search, the grammar
libraries match it whole; with anchors all three agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

# -- JSON schemas ---------------------------------------------------------------------------------

_NAME = {"type": "string", "minLength": 1, "maxLength": 40}
_SHORT = {"type": "string", "minLength": 1, "maxLength": 20}
# xgrammar's "email" format has no length bound (it ignores maxLength beside a format), so a
# small model can loop inside one: email-like strings are bounded by a pattern instead.
_EMAIL = {"type": "string", "pattern": "[a-z]{1,12}[.]?[a-z]{0,8}@[a-z]{2,12}[.](com|org|net)"}
_UUID = {"type": "string", "format": "uuid"}
_DATE = {"type": "string", "format": "date"}
# RFC 3339 date-times and times take any number of fractional digits, and xgrammar's formats
# allow them all: bounded by a pattern instead.
_DATE_TIME = {
    "type": "string",
    "pattern": "[0-9]{4}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-5][0-9]Z",
}
_CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}

TWENTY_PROPERTY_SCHEMA: dict[str, Any] = {
    "title": "CustomerRecord",
    "type": "object",
    "properties": {
        "customer_id": _UUID,
        "first_name": _SHORT,
        "last_name": _SHORT,
        "email": _EMAIL,
        "phone": {"type": "string", "pattern": r"^\+?[0-9]{7,14}$"},
        "birth_date": _DATE,
        "signup_at": _DATE_TIME,
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "city": {"type": "string", "maxLength": 30},
        "postal_code": {"type": "string", "pattern": "^[0-9A-Z]{3,8}$"},
        "tier": {"type": "string", "enum": ["free", "basic", "pro", "enterprise"]},
        "active": {"type": "boolean"},
        "verified": {"type": "boolean"},
        "lifetime_value": {"type": "number", "minimum": 0, "maximum": 1000000},
        "orders_count": {"type": "integer", "minimum": 0, "maximum": 10000},
        "last_order_id": {"type": ["string", "null"], "pattern": "^ORD-[0-9]{6}$"},
        "preferred_language": {"type": "string", "enum": ["en", "fr", "de", "es", "ja"]},
        "marketing_opt_in": {"type": "boolean"},
        "tags": {"type": "array", "items": _SHORT, "maxItems": 5},
        "notes": {"type": ["string", "null"], "maxLength": 40},
    },
    "required": [
        "customer_id",
        "first_name",
        "last_name",
        "email",
        "country",
        "tier",
        "active",
        "orders_count",
    ],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "sentiment",
        {
            "type": "object",
            "properties": {
                "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["label", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": _EMAIL,
                "is_student": {"type": "boolean"},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "address",
        {
            "type": "object",
            "properties": {
                "street": _NAME,
                "city": {"type": "string", "minLength": 1, "maxLength": 30},
                "state": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                "country": {"type": "string", "enum": ["US", "CA", "MX"]},
            },
            "required": ["street", "city", "state", "zip", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "product",
        {
            "type": "object",
            "properties": {
                "id": _UUID,
                "name": _NAME,
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100000},
                "currency": _CURRENCY,
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": _SHORT, "maxItems": 5},
            },
            "required": ["id", "name", "price", "currency", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "order",
        {
            "type": "object",
            "$defs": {
                "line_item": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        "unit_price": {"type": "number", "minimum": 0, "maximum": 10000},
                    },
                    "required": ["sku", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
                "customer": {
                    "type": "object",
                    "properties": {"name": _NAME, "email": _EMAIL},
                    "required": ["name", "email"],
                    "additionalProperties": False,
                },
            },
            "properties": {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "customer": {"$ref": "#/$defs/customer"},
                "items": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/line_item"},
                    "minItems": 1,
                    "maxItems": 5,
                },
                "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
                "created_at": _DATE_TIME,
                "gift": {"type": "boolean"},
            },
            "required": ["order_id", "customer", "items", "status", "created_at"],
            "additionalProperties": False,
        },
    ),
    (
        "event",
        {
            "type": "object",
            "properties": {
                "title": _NAME,
                "date": _DATE,
                "start_time": {"type": "string", "pattern": "[0-2][0-9]:[0-5][0-9]"},
                "location": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
                "attendees": {"type": "array", "items": _EMAIL, "maxItems": 5},
            },
            "required": ["title", "date", "location", "attendees"],
            "additionalProperties": False,
        },
    ),
    (
        "classification",
        {
            "type": "object",
            "properties": {
                "task": {"const": "classification"},
                "label": {"type": "string", "enum": ["spam", "ham", "phishing", "promotion"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "explanation": {"type": "string", "maxLength": 40},
            },
            "required": ["task", "label", "score"],
            "additionalProperties": False,
        },
    ),
    (
        "weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 30},
                "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                "condition": {
                    "type": "string",
                    "enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"],
                },
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind_kph": {"type": "number", "minimum": 0, "maximum": 400},
            },
            "required": ["city", "temperature_c", "condition", "humidity"],
            "additionalProperties": False,
        },
    ),
    (
        "book",
        {
            "type": "object",
            "properties": {
                "title": _NAME,
                "author": _NAME,
                "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
                "year": {"type": "integer", "minimum": 1450, "maximum": 2100},
                "genres": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": ["fiction", "history", "science", "poetry", "fantasy"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "rating": {"type": ["number", "null"], "minimum": 1, "maximum": 5},
            },
            "required": ["title", "author", "year", "genres", "rating"],
            "additionalProperties": False,
        },
    ),
    (
        "user_settings",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"},
                "settings": {
                    "type": "object",
                    "properties": {
                        "theme": {"type": "string", "enum": ["light", "dark", "system"]},
                        "notifications": {"type": "boolean"},
                        "language": {"type": "string", "enum": ["en", "fr", "de"]},
                        "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
                    },
                    "required": ["theme", "notifications", "language"],
                    "additionalProperties": False,
                },
                "roles": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                    "maxItems": 3,
                },
            },
            "required": ["username", "settings", "roles"],
            "additionalProperties": False,
        },
    ),
    (
        "api_error",
        {
            "type": "object",
            "properties": {
                "code": {"type": "integer", "minimum": 400, "maximum": 599},
                "message": {"type": "string", "maxLength": 40},
                "details": {"type": ["string", "null"], "maxLength": 40},
                "retryable": {"type": "boolean"},
            },
            "required": ["code", "message", "details", "retryable"],
            "additionalProperties": False,
        },
    ),
    (
        "geo_point",
        {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
                "label": {"type": "string", "maxLength": 30},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    ),
    (
        "network_device",
        {
            "type": "object",
            "properties": {
                "hostname": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,20}$"},
                "ip": {"type": "string", "format": "ipv4"},
                "mac": {"type": "string", "pattern": "^([0-9a-f]{2}:){5}[0-9a-f]{2}$"},
                "vendor": {"type": "string", "enum": ["cisco", "juniper", "arista", "other"]},
                "online": {"type": "boolean"},
                "last_seen": _DATE_TIME,
                "open_ports": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "maxItems": 5,
                },
            },
            "required": ["hostname", "ip", "mac", "vendor", "online", "last_seen", "open_ports"],
            "additionalProperties": False,
        },
    ),
    (
        "recipe",
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": _SHORT,
                            "quantity": {
                                "type": "number",
                                "exclusiveMinimum": 0,
                                "maximum": 1000,
                            },
                            "unit": {"type": "string", "enum": ["g", "ml", "tsp", "tbsp", "cup"]},
                        },
                        "required": ["name", "quantity", "unit"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 5,
                },
                "vegetarian": {"type": "boolean"},
            },
            "required": ["name", "servings", "ingredients", "vegetarian"],
            "additionalProperties": False,
        },
    ),
    (
        "job_posting",
        {
            "type": "object",
            "properties": {
                "title": _NAME,
                "company": _NAME,
                "location": {"type": "string", "maxLength": 30},
                "remote": {"type": "boolean"},
                "level": {"type": "string", "enum": ["junior", "mid", "senior", "staff"]},
                "salary": {
                    "type": "object",
                    "properties": {
                        "min": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "max": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "currency": _CURRENCY,
                    },
                    "required": ["min", "max", "currency"],
                    "additionalProperties": False,
                },
                "skills": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 5},
                "posted": _DATE,
            },
            "required": ["title", "company", "remote", "level", "salary", "skills", "posted"],
            "additionalProperties": False,
        },
    ),
    (
        "movie_review",
        {
            "type": "object",
            "properties": {
                "movie": _NAME,
                "rating": {"type": "integer", "minimum": 1, "maximum": 10},
                "summary": {"type": "string", "maxLength": 40},
                "spoilers": {"type": "boolean"},
            },
            "required": ["movie", "rating", "summary", "spoilers"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_call",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "get_weather"},
                        "arguments": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string", "minLength": 1, "maxLength": 30},
                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                            },
                            "required": ["city", "unit"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "search_web"},
                        "arguments": {
                            "type": "object",
                            "properties": {
                                "query": _NAME,
                                "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                            },
                            "required": ["query", "max_results"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
    (
        "shape",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "circle"},
                                "radius": {
                                    "type": "number",
                                    "exclusiveMinimum": 0,
                                    "maximum": 1000,
                                },
                            },
                            "required": ["kind", "radius"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "rectangle"},
                                "width": {
                                    "type": "number",
                                    "exclusiveMinimum": 0,
                                    "maximum": 1000,
                                },
                                "height": {
                                    "type": "number",
                                    "exclusiveMinimum": 0,
                                    "maximum": 1000,
                                },
                            },
                            "required": ["kind", "width", "height"],
                            "additionalProperties": False,
                        },
                    ]
                },
                "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
            "required": ["shape", "color"],
            "additionalProperties": False,
        },
    ),
    (
        "contact",
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "phone": {
                    "anyOf": [
                        {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}$"},
                        {"type": "null"},
                    ]
                },
                "email": {"anyOf": [_EMAIL, {"type": "null"}]},
                "favorite": {"type": "boolean"},
            },
            "required": ["name", "phone", "email"],
            "additionalProperties": False,
        },
    ),
    (
        "invoice",
        {
            "type": "object",
            "$defs": {
                "money": {
                    "type": "object",
                    "properties": {
                        "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                        "currency": _CURRENCY,
                    },
                    "required": ["amount", "currency"],
                    "additionalProperties": False,
                },
                "line": {
                    "type": "object",
                    "properties": {
                        "description": {"type": "string", "minLength": 1, "maxLength": 30},
                        "amount": {"$ref": "#/$defs/money"},
                    },
                    "required": ["description", "amount"],
                    "additionalProperties": False,
                },
            },
            "properties": {
                "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{5}$"},
                "issued": _DATE,
                "due": _DATE,
                "lines": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/line"},
                    "minItems": 1,
                    "maxItems": 5,
                },
                "total": {"$ref": "#/$defs/money"},
                "paid": {"type": "boolean"},
            },
            "required": ["invoice_number", "issued", "due", "lines", "total", "paid"],
            "additionalProperties": False,
        },
    ),
    (
        "flight",
        {
            "type": "object",
            "properties": {
                "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "departure": _DATE_TIME,
                "arrival": _DATE_TIME,
                "seats_available": {"type": "integer", "minimum": 0, "maximum": 500},
                "status": {
                    "type": "string",
                    "enum": ["scheduled", "boarding", "departed", "delayed", "cancelled"],
                },
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 20000},
            },
            "required": [
                "flight_number",
                "origin",
                "destination",
                "departure",
                "arrival",
                "seats_available",
                "status",
                "price",
            ],
            "additionalProperties": False,
        },
    ),
    (
        "log_entry",
        {
            "type": "object",
            "properties": {
                "timestamp": _DATE_TIME,
                "level": {"type": "string", "enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,20}$"},
                "message": {"type": "string", "maxLength": 40},
                "request_id": _UUID,
                "latency_ms": {"type": "number", "minimum": 0, "maximum": 600000},
                "status_code": {"type": "integer", "minimum": 100, "maximum": 599},
            },
            "required": ["timestamp", "level", "service", "message", "request_id"],
            "additionalProperties": False,
        },
    ),
    (
        "medication",
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "dose_mg": {"type": "number", "exclusiveMinimum": 0, "maximum": 2000},
                "frequency": {
                    "type": "string",
                    "enum": ["once daily", "twice daily", "every 8 hours", "as needed"],
                },
                "with_food": {"type": "boolean"},
                "notes": {"type": ["string", "null"], "maxLength": 40},
            },
            "required": ["name", "dose_mg", "frequency", "with_food", "notes"],
            "additionalProperties": False,
        },
    ),
    (
        "todo",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 100000},
                "title": _NAME,
                "done": {"type": "boolean"},
                "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                "due": {"anyOf": [_DATE, {"type": "null"}]},
                "tags": {"type": "array", "items": _SHORT, "maxItems": 3},
            },
            "required": ["id", "title", "done", "priority", "due"],
            "additionalProperties": False,
        },
    ),
    (
        "color_palette",
        {
            "type": "object",
            "properties": {
                "name": _SHORT,
                "colors": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
                    "minItems": 2,
                    "maxItems": 5,
                },
            },
            "required": ["name", "colors"],
            "additionalProperties": False,
        },
    ),
    (
        "matrix_2x2",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": -100, "maximum": 100},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                },
                "determinant": {"type": "integer", "minimum": -20000, "maximum": 20000},
            },
            "required": ["rows", "determinant"],
            "additionalProperties": False,
        },
    ),
    (
        "feature_flags",
        {
            "type": "object",
            "properties": {
                "dark_mode": {"type": "boolean"},
                "beta_features": {"type": "boolean"},
                "new_checkout": {"type": "boolean"},
                "analytics": {"type": ["boolean", "null"]},
                "rollout_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["dark_mode", "beta_features", "new_checkout", "analytics"],
            "additionalProperties": False,
        },
    ),
    (
        "release",
        {
            "type": "object",
            "properties": {
                "schema_version": {"const": 2},
                "kind": {"const": "release"},
                "version": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"},
                "released": _DATE,
                "stable": {"type": "boolean"},
                "changes": {"type": "array", "items": _NAME, "maxItems": 5},
            },
            "required": ["schema_version", "kind", "version", "released", "stable", "changes"],
            "additionalProperties": False,
        },
    ),
    (
        "employee",
        {
            "type": "object",
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "minLength": 1, "maxLength": 30},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
                "department": {
                    "type": "object",
                    "properties": {
                        "name": {
                            "type": "string",
                            "enum": ["engineering", "sales", "marketing", "finance", "hr"],
                        },
                        "office": {"$ref": "#/$defs/address"},
                    },
                    "required": ["name", "office"],
                    "additionalProperties": False,
                },
            },
            "properties": {
                "employee_id": {"type": "string", "pattern": "^E[0-9]{5}$"},
                "name": _NAME,
                "email": _EMAIL,
                "department": {"$ref": "#/$defs/department"},
                "home": {"$ref": "#/$defs/address"},
                "start_date": _DATE,
                "full_time": {"type": "boolean"},
                "manager_id": {"type": ["string", "null"], "pattern": "^E[0-9]{5}$"},
            },
            "required": [
                "employee_id",
                "name",
                "email",
                "department",
                "start_date",
                "full_time",
                "manager_id",
            ],
            "additionalProperties": False,
        },
    ),
    ("customer_record_20", TWENTY_PROPERTY_SCHEMA),
    (
        "survey_response",
        {
            "type": "object",
            "properties": {
                "respondent_id": _UUID,
                "answers": {
                    "type": "object",
                    "properties": {
                        "satisfaction": {"type": "integer", "minimum": 1, "maximum": 5},
                        "recommend": {"type": "boolean"},
                        "frequency": {"type": "string", "enum": ["daily", "weekly", "monthly"]},
                        "favorite_feature": {"type": "string", "maxLength": 30},
                    },
                    "required": ["satisfaction", "recommend", "frequency"],
                    "additionalProperties": False,
                },
                "comments": {"type": ["string", "null"], "maxLength": 40},
            },
            "required": ["respondent_id", "answers"],
            "additionalProperties": False,
        },
    ),
    (
        "bank_transaction",
        {
            "type": "object",
            "properties": {
                "id": _UUID,
                "amount": {"type": "number", "minimum": -1000000, "maximum": 1000000},
                "currency": _CURRENCY,
                "type": {"type": "string", "enum": ["debit", "credit", "transfer"]},
                "timestamp": _DATE_TIME,
                "counterparty": {"type": "string", "maxLength": 30},
                "category": {
                    "type": "string",
                    "enum": ["groceries", "rent", "salary", "travel", "other"],
                },
                "pending": {"type": "boolean"},
            },
            "required": ["id", "amount", "currency", "type", "timestamp", "pending"],
            "additionalProperties": False,
        },
    ),
    (
        "server_config",
        {
            "type": "object",
            "properties": {
                "host": {"type": "string", "format": "ipv4"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "tls": {"type": "boolean"},
                "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
                "allowed_origins": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^https://[a-z0-9.-]{1,30}$"},
                    "maxItems": 3,
                },
            },
            "required": ["host", "port", "tls", "workers", "log_level"],
            "additionalProperties": False,
        },
    ),
    (
        "entities",
        {
            "type": "object",
            "properties": {
                "people": {"type": "array", "items": _SHORT, "maxItems": 5},
                "organizations": {"type": "array", "items": _SHORT, "maxItems": 5},
                "locations": {"type": "array", "items": _SHORT, "maxItems": 5},
                "dates": {"type": "array", "items": _DATE, "maxItems": 3},
            },
            "required": ["people", "organizations", "locations", "dates"],
            "additionalProperties": False,
        },
    ),
    (
        "qa_answer",
        {
            "type": "object",
            "properties": {
                "answerable": {"type": "boolean"},
                "answer": {"type": ["string", "null"], "maxLength": 40},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "source_ids": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "maxItems": 3,
                },
            },
            "required": ["answerable", "answer", "confidence", "source_ids"],
            "additionalProperties": False,
        },
    ),
    (
        "yes_no",
        {
            "type": "object",
            "properties": {
                "answer": {"type": "boolean"},
                "reason": {"type": "string", "minLength": 1, "maxLength": 40},
            },
            "required": ["answer", "reason"],
        },
    ),
    (
        "string_list",
        {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 5},
    ),
]

# Schemas of 5..20 properties (nested ones counted), with formats, refs, patterns and arrays.
BENCHMARK_SCHEMAS: list[str] = [
    "order",
    "invoice",
    "job_posting",
    "network_device",
    "flight",
    "log_entry",
    "employee",
    "customer_record_20",
]

SCHEMA_EXAMPLES: dict[str, Any] = {
    "sentiment": {"label": "positive", "confidence": 0.92},
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "is_student": False},
    "address": {
        "street": "12 Main St",
        "city": "Springfield",
        "state": "IL",
        "zip": "62704",
        "country": "US",
    },
    "product": {
        "id": "3f2b8c1e-9d4a-4c6b-8e2f-1a7d5c9b0e43",
        "name": "Wireless Mouse",
        "price": 24.99,
        "currency": "USD",
        "in_stock": True,
        "tags": ["electronics", "office"],
    },
    "order": {
        "order_id": "ORD-004217",
        "customer": {"name": "Grace Hopper", "email": "grace@navy.org"},
        "items": [
            {"sku": "ABC-1234", "quantity": 2, "unit_price": 9.5},
            {"sku": "XYZ-0042", "quantity": 1, "unit_price": 120},
        ],
        "status": "shipped",
        "created_at": "2024-05-17T14:32:00Z",
        "gift": False,
    },
    "event": {
        "title": "Team offsite",
        "date": "2024-09-12",
        "start_time": "09:30:00Z",
        "location": None,
        "attendees": ["bob@example.com", "eve@example.org"],
    },
    "classification": {
        "task": "classification",
        "label": "phishing",
        "score": 0.87,
        "explanation": "asks for a password reset link",
    },
    "weather": {
        "city": "Oslo",
        "temperature_c": -3.5,
        "condition": "snow",
        "humidity": 81,
        "wind_kph": 14,
    },
    "book": {
        "title": "Dune",
        "author": "Frank Herbert",
        "isbn": "978-0441013593",
        "year": 1965,
        "genres": ["fiction", "fantasy"],
        "rating": 4.5,
    },
    "user_settings": {
        "username": "jdoe_42",
        "settings": {"theme": "dark", "notifications": True, "language": "en", "font_size": 14},
        "roles": ["editor"],
    },
    "api_error": {
        "code": 404,
        "message": "resource not found",
        "details": None,
        "retryable": False,
    },
    "geo_point": {"lat": 48.8584, "lon": 2.2945, "label": "Eiffel Tower"},
    "network_device": {
        "hostname": "core-sw-01",
        "ip": "10.0.12.7",
        "mac": "00:1a:2b:3c:4d:5e",
        "vendor": "arista",
        "online": True,
        "last_seen": "2024-06-01T08:15:30Z",
        "open_ports": [22, 443, 8080],
    },
    "recipe": {
        "name": "Pancakes",
        "servings": 4,
        "ingredients": [
            {"name": "flour", "quantity": 200, "unit": "g"},
            {"name": "milk", "quantity": 300, "unit": "ml"},
            {"name": "sugar", "quantity": 1.5, "unit": "tbsp"},
        ],
        "vegetarian": True,
    },
    "job_posting": {
        "title": "Backend Engineer",
        "company": "Acme Corp",
        "location": "Berlin",
        "remote": True,
        "level": "senior",
        "salary": {"min": 70000, "max": 95000, "currency": "EUR"},
        "skills": ["python", "postgres", "kubernetes"],
        "posted": "2024-03-04",
    },
    "movie_review": {
        "movie": "Arrival",
        "rating": 9,
        "summary": "quiet, clever first-contact story",
        "spoilers": False,
    },
    "tool_call": {"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}},
    "shape": {"shape": {"kind": "rectangle", "width": 3, "height": 4.5}, "color": "#1e90ff"},
    "contact": {
        "name": "Alan Turing",
        "phone": "+44 207 946 0958",
        "email": None,
        "favorite": True,
    },
    "invoice": {
        "invoice_number": "INV-00731",
        "issued": "2024-02-01",
        "due": "2024-03-01",
        "lines": [
            {"description": "Consulting", "amount": {"amount": 1200, "currency": "GBP"}},
            {"description": "Travel", "amount": {"amount": 180.4, "currency": "GBP"}},
        ],
        "total": {"amount": 1380.4, "currency": "GBP"},
        "paid": False,
    },
    "flight": {
        "flight_number": "LH454",
        "origin": "FRA",
        "destination": "SFO",
        "departure": "2024-07-20T13:05:00Z",
        "arrival": "2024-07-20T15:55:00Z",
        "seats_available": 12,
        "status": "scheduled",
        "price": 842.5,
    },
    "log_entry": {
        "timestamp": "2024-04-11T22:01:09Z",
        "level": "ERROR",
        "service": "payments-api",
        "message": "timeout calling ledger",
        "request_id": "0b7c5a1e-2f3d-4e8a-9c6b-5d4e3f2a1b0c",
        "latency_ms": 30012.4,
        "status_code": 504,
    },
    "medication": {
        "name": "Ibuprofen",
        "dose_mg": 400,
        "frequency": "every 8 hours",
        "with_food": True,
        "notes": None,
    },
    "todo": {
        "id": 17,
        "title": "Renew passport",
        "done": False,
        "priority": "high",
        "due": "2024-08-30",
        "tags": ["admin"],
    },
    "color_palette": {"name": "sunset", "colors": ["#FF5E5B", "#D8D8D8", "#FFED66"]},
    "matrix_2x2": {"rows": [[3, 8], [4, 6]], "determinant": -14},
    "feature_flags": {
        "dark_mode": True,
        "beta_features": False,
        "new_checkout": True,
        "analytics": None,
        "rollout_percent": 25,
    },
    "release": {
        "schema_version": 2,
        "kind": "release",
        "version": "1.4.2",
        "released": "2024-10-01",
        "stable": True,
        "changes": ["fix crash on empty input", "faster startup"],
    },
    "employee": {
        "employee_id": "E00421",
        "name": "Linus Pauling",
        "email": "linus@example.com",
        "department": {
            "name": "engineering",
            "office": {"city": "Zurich", "country": "CH"},
        },
        "home": {"city": "Basel", "country": "CH"},
        "start_date": "2021-01-04",
        "full_time": True,
        "manager_id": None,
    },
    "customer_record_20": {
        "customer_id": "9a1c3e5f-7b2d-4f6a-8c0e-2d4f6a8c0e1b",
        "first_name": "Maria",
        "last_name": "Garcia",
        "email": "maria.garcia@example.com",
        "phone": "+34911234567",
        "birth_date": "1988-11-23",
        "signup_at": "2022-06-14T10:20:30Z",
        "country": "ES",
        "city": "Madrid",
        "postal_code": "28013",
        "tier": "pro",
        "active": True,
        "verified": True,
        "lifetime_value": 1520.75,
        "orders_count": 23,
        "last_order_id": "ORD-118842",
        "preferred_language": "es",
        "marketing_opt_in": False,
        "tags": ["vip", "newsletter"],
        "notes": None,
    },
    "survey_response": {
        "respondent_id": "5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9",
        "answers": {
            "satisfaction": 4,
            "recommend": True,
            "frequency": "weekly",
            "favorite_feature": "offline mode",
        },
        "comments": "works well on slow networks",
    },
    "bank_transaction": {
        "id": "1d2e3f4a-5b6c-4d7e-8f9a-0b1c2d3e4f5a",
        "amount": -54.2,
        "currency": "EUR",
        "type": "debit",
        "timestamp": "2024-05-02T18:44:10Z",
        "counterparty": "City Market",
        "category": "groceries",
        "pending": False,
    },
    "server_config": {
        "host": "192.168.1.20",
        "port": 8443,
        "tls": True,
        "workers": 8,
        "log_level": "info",
        "allowed_origins": ["https://app.example.com"],
    },
    "entities": {
        "people": ["Marie Curie", "Pierre Curie"],
        "organizations": ["Sorbonne"],
        "locations": ["Paris", "Warsaw"],
        "dates": ["1903-12-10"],
    },
    "qa_answer": {
        "answerable": True,
        "answer": "Canberra",
        "confidence": 0.97,
        "source_ids": [3, 7],
    },
    "yes_no": {"answer": True, "reason": "the invoice total matches the lines"},
    "string_list": ["alpha", "beta", "gamma"],
}

# -- regexes, choices, grammars -------------------------------------------------------------------

REGEXES: list[tuple[str, str]] = [
    ("us_phone", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("iso_date", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("hex_color", r"#[0-9a-fA-F]{6}"),
    ("simple_email", r"[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.(com|org|net|io)"),
    ("semver", r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})"),
    ("ipv4", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    ("time_24h", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("capitalized_words", r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,3}"),
]

REGEX_EXAMPLES: dict[str, str] = {
    "us_phone": "(415) 555-0132",
    "iso_date": "2024-02-29",
    "hex_color": "#1E90ff",
    "simple_email": "jane.doe@example.com",
    "semver": "10.2.0",
    "ipv4": "172.16.254.1",
    "time_24h": "23:07",
    "capitalized_words": "New York City",
}

CHOICES: list[tuple[str, list[str]]] = [
    ("sentiment", ["positive", "negative", "neutral"]),
    ("yes_no", ["yes", "no"]),
    ("weekday", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]),
    ("priority", ["P0 - critical", "P1 - high", "P2 - medium", "P3 - low"]),
    ("language", ["Python", "Rust", "Go", "TypeScript", "C++", "Java"]),
]

GRAMMARS: list[tuple[str, str]] = [
    (
        # No recursion: a parenthesized group holds numbers and operators only.
        "arithmetic",
        """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,3}
factor ::= number | "(" number (("+" | "-" | "*" | "/") number){0,3} ")"
number ::= [0-9]{1,4}
""",
    ),
    (
        "sql_select",
        """root ::= "SELECT " columns " FROM " ident where? limit? ";"
columns ::= "*" | ident (", " ident){0,3}
ident ::= [a-z] [a-z_]{0,11}
where ::= " WHERE " ident " " op " " value
op ::= "=" | "!=" | "<" | ">" | "<=" | ">="
value ::= [0-9]{1,6} | "'" [a-zA-Z0-9 ]{0,20} "'"
limit ::= " LIMIT " [1-9] [0-9]{0,2}
""",
    ),
    (
        "yes_no_reason",
        """root ::= answer ". Reason: " reason "."
answer ::= "Yes" | "No"
reason ::= [a-zA-Z] [a-zA-Z ,']{0,59}
""",
    ),
    (
        "key_value_list",
        """root ::= pair ("; " pair){0,4}
pair ::= key "=" value
key ::= [a-z] [a-z_]{0,11}
value ::= [0-9]{1,6} | "true" | "false" | "\\"" [a-zA-Z0-9 ]{0,20} "\\""
""",
    ),
]

GRAMMAR_EXAMPLES: dict[str, str] = {
    "arithmetic": "12*(3+4)-7/2",
    "sql_select": "SELECT name, age FROM users WHERE age >= 18 LIMIT 10;",
    "yes_no_reason": "No. Reason: the sky is blue, not green.",
    "key_value_list": 'retries=3; verbose=true; name="db primary"',
}

_NUM = r"[0-9]{1,4}"
_FACTOR = rf"(?:{_NUM}|\({_NUM}(?:[-+*/]{_NUM}){{0,3}}\))"
_TERM = rf"{_FACTOR}(?:[*/]{_FACTOR}){{0,3}}"
_IDENT = r"[a-z][a-z_]{0,11}"
_GRAMMAR_RES: dict[str, re.Pattern[str]] = {
    "arithmetic": re.compile(rf"{_TERM}(?:[-+]{_TERM}){{0,3}}"),
    "sql_select": re.compile(
        rf"SELECT (?:\*|{_IDENT}(?:, {_IDENT}){{0,3}}) FROM {_IDENT}"
        rf"(?: WHERE {_IDENT} (?:=|!=|<|>|<=|>=) (?:[0-9]{{1,6}}|'[a-zA-Z0-9 ]{{0,20}}'))?"
        r"(?: LIMIT [1-9][0-9]{0,2})?;"
    ),
    "yes_no_reason": re.compile(r"(?:Yes|No)\. Reason: [a-zA-Z][a-zA-Z ,']{0,59}\."),
    "key_value_list": re.compile(
        rf'{_IDENT}=(?:[0-9]{{1,6}}|true|false|"[a-zA-Z0-9 ]{{0,20}}")'
        rf'(?:; {_IDENT}=(?:[0-9]{{1,6}}|true|false|"[a-zA-Z0-9 ]{{0,20}}")){{0,4}}'
    ),
}

GRAMMAR_CHECKS: dict[str, Callable[[str], bool]] = {
    name: (lambda text, pattern=pattern: pattern.fullmatch(text) is not None)
    for name, pattern in _GRAMMAR_RES.items()
}

# -- checkers -------------------------------------------------------------------------------------


def schema_named(name: str) -> dict[str, Any]:
    return dict(SCHEMAS)[name]


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """Why `instance` does not satisfy `schema` (formats checked); [] when it does."""
    try:
        import jsonschema_rs
    except ImportError:
        import jsonschema  # type: ignore[import-untyped]

        cls = jsonschema.validators.validator_for(schema)
        v = cls(schema, format_checker=cls.FORMAT_CHECKER)
        return [e.message for e in v.iter_errors(instance)]
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    return [e.message for e in validator.iter_errors(instance)]


def check_schema(schema: dict[str, Any], text: str) -> bool:
    """Whether `text` is one JSON value that satisfies `schema`."""
    try:
        instance = json.loads(text)
    except ValueError:
        return False
    return not schema_errors(schema, instance)


def check_regex(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


def check_choice(choices: list[str], text: str) -> bool:
    return text in choices


def check_grammar(name: str, text: str) -> bool:
    return GRAMMAR_CHECKS[name](text)


def _self_check() -> None:
    """Every example satisfies its constraint (run: python -m tests.json_schemas)."""
    names = [n for n, _ in SCHEMAS]
    assert len(names) == len(set(names)) >= 32, names
    assert len(BENCHMARK_SCHEMAS) == 8 and set(BENCHMARK_SCHEMAS) <= set(names)
    assert len(TWENTY_PROPERTY_SCHEMA["properties"]) == 20
    assert set(SCHEMA_EXAMPLES) == set(names)
    for name, schema in SCHEMAS:
        errors = schema_errors(schema, SCHEMA_EXAMPLES[name])
        assert not errors, (name, errors)
    for name, regex in REGEXES:
        assert check_regex(regex, REGEX_EXAMPLES[name]), name
    for name, _ in GRAMMARS:
        assert check_grammar(name, GRAMMAR_EXAMPLES[name]), name
    print(
        f"{len(SCHEMAS)} schemas, {len(REGEXES)} regexes, {len(CHOICES)} choice lists, "
        f"{len(GRAMMARS)} grammars: all examples valid"
    )


if __name__ == "__main__":
    _self_check()
