"""The OpenAPI schema (/openapi.json, /docs): the error responses every route declares, the
request bodies the routes read themselves, and the stream events' shapes.

The routes read their bodies themselves (`gateway.bodies`, off the event loop when large), so
FastAPI does not see them: each route declares its body with `request_body_doc`, and
`install_openapi` adds the models' schemas. Validation errors are 400 in OpenAI's shape here,
never FastAPI's 422, which the schema leaves out.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "The control plane's queue is full; retry after Retry-After seconds"),
        (503, "The control plane is unavailable"),
    ]
}


def request_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring `model` as its required JSON body, as FastAPI
    declares a body parameter (`install_openapi` adds the schemas)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"content": {"application/json": {"schema": ref}}, "required": True}}


def sse_response(chunk: type[BaseModel]) -> dict[str, object]:
    """An OpenAPI 200 whose body is JSON, or with `"stream": true` server-sent events."""
    return {
        "description": "The whole answer; with `stream: true`, server-sent events instead",
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "string",
                    "description": f"`data: <{chunk.__name__} as JSON>` events, the last one "
                    "`data: [DONE]`",
                }
            }
        },
    }


def document_models(schema: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """Adds the models' JSON schemas (input side) under `components.schemas`, and those they
    refer to where the name is not taken yet."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in doc.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = doc


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """The app's schema, built once: its routes, without 422s, and `models` (the request
    bodies and the stream events' shapes that the text/event-stream descriptions name)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            document_models(schema, models)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
