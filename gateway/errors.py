"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the one
place where gRPC status codes from the control plane become HTTP statuses."""

from __future__ import annotations

import re
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.log import get_logger

log = get_logger(__name__)


class APIError(Exception):
    """An error the client receives as an OpenAI error body with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# status code -> (HTTP status, OpenAI error type, OpenAI error code)
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "duplicate_request_id"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}


# gRPC's own size check: "CLIENT: Sent message larger than max (17825797 vs. 16777216)".
_TOO_LARGE = re.compile(
    r"(?:(CLIENT|SERVER): )?(Sent|Received) message larger than max \((\d+) vs\. (\d+)\)"
)


def _too_large(details: str) -> APIError | None:
    """RESOURCE_EXHAUSTED for a message past gRPC's size limit is no full queue: retrying can
    never help. Our request too large (we could not send it, the control plane would not take
    it) is a 413; the answer too large (a final-only completion) a 400."""
    m = _TOO_LARGE.search(details)
    if m is None:
        return None
    side, direction, size, limit = m.groups()
    if (side == "SERVER") == (direction == "Sent"):  # the answer, on either side
        return bad_request(
            f"the completion ({size} bytes) exceeds the {limit}-byte limit on one message: ask "
            "for fewer tokens or logprobs, or stream it"
        )
    return APIError(
        413,
        f"the request ({size} bytes as sent to the control plane) exceeds its limit of {limit} "
        "bytes",
        code="request_too_large",
    )


def from_grpc(exc: grpc.aio.AioRpcError, retry_after_s: int = 1) -> APIError:
    """Maps a control-plane error to the HTTP error the client sees."""
    code = exc.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        too_large = _too_large(exc.details() or "")
        if too_large is not None:
            return too_large
    status, type_, err_code = _GRPC_TO_HTTP.get(code, (500, "server_error", "internal_error"))
    message = exc.details() or code.name
    if status == 503:
        message = f"the control plane is unavailable: {message}"
    headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
    if status >= 500:
        log.warning("upstream_error", grpc_code=code.name, details=exc.details())
    return APIError(status, message, type=type_, code=err_code, headers=headers)


# What a field with several accepted shapes takes, for a message better than the first miss.
_UNION_SHAPES = {
    "prompt": "a non-empty string, a list of them, a list of token ids or a list of token-id "
    f"lists (token ids in [0, {2**32 - 1}])",
    "stop": "a non-empty string or a list of them",
    "content": "a string or a list of content parts",
    "guided_json": "a JSON schema: an object, or a string holding one",
    "json": "a JSON schema: an object, or a string holding one",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": '
    "<one of the tools>}}",
}


# pydantic's range errors: the ctx key of the bound and the words its message uses.
_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "greater than or equal to"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "less than or equal to"),
}


def _bound_message(kind: str, ctx: dict[str, Any]) -> str | None:
    """A range error with a float bound written short (float32's smallest normal number as
    1.18e-38): pydantic writes it out in full, 40 digits. None to keep pydantic's message."""
    key, words = _BOUNDS.get(kind, ("", ""))
    bound = ctx.get(key)
    if not isinstance(bound, float) or len(repr(bound)) <= 12:
        return None
    return f"Input should be {words} {bound:.3g}"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc: list[str] = []
    in_union = False
    for part in first.get("loc", ())[1:]:  # loc[0] is "body"
        # Union members show up as tags ("constrained-str", "list[int]"): the field ends there.
        if not (isinstance(part, int) or str(part).isidentifier()):
            in_union = True
            break
        loc.append(str(part))
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', 'decode error')}", None
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    msg = _bound_message(kind, first.get("ctx") or {}) or msg
    if in_union and loc and loc[-1] in _UNION_SHAPES:
        return f"{param}: expected {_UNION_SHAPES[loc[-1]]}", param
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return (f"{param}: {msg}" if param else msg), param


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the gateway in OpenAI's shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return bad_request(message, param).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers) if exc.headers else None
        err = APIError(exc.status_code, str(exc.detail), type=type_, headers=headers)
        return err.response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled_error", error=f"{type(exc).__name__}: {exc}")
        return APIError(
            500, "internal error", type="server_error", code="internal_error"
        ).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
