"""Pure ASGI middleware (streaming-safe): request ids and access logs, API keys, body limits.

Order, outermost first: RequestContext (so every response carries `x-request-id`, errors
included), ApiKeyAuth (reject before reading a body), BodyLimit (read the body once, bounded).
"""

from __future__ import annotations

import hmac
import re
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError
from pagedserve.log import get_logger

log = get_logger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
DRAIN_BYTES = 64 << 20


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


def request_id_of(scope: Scope) -> str:
    state: MutableMapping[str, Any] = scope.setdefault("state", {})
    rid = state.get("request_id")
    assert isinstance(rid, str), "RequestContext must run first"
    return rid


class RequestContext:
    """Accepts a well-formed `x-request-id` or makes one, binds it to every log line of the
    request, echoes it in the response and logs one access line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER.encode())
        text = given.decode("latin-1") if given is not None else ""
        rid = text if _VALID_REQUEST_ID.match(text) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        structlog.contextvars.bind_contextvars(request_id=rid)
        start = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # Probes (/health, /metrics every few seconds) are logged only when they fail.
            if scope["path"].startswith("/v1/") or not 200 <= status < 300:
                log.info(
                    "http_request",
                    method=scope.get("method"),
                    path=scope.get("path"),
                    status=status,
                    duration_s=round(time.monotonic() - start, 4),
                )
            structlog.contextvars.unbind_contextvars("request_id")


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on /v1/*; /health and /metrics stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            message = (
                "missing API key: send Authorization: Bearer <key>"
                if not auth
                else "incorrect API key"
            )
            err = APIError(401, message, code="invalid_api_key")
            err.headers["WWW-Authenticate"] = "Bearer"
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request body once, up to `max_bytes` (413 beyond), rejects bodies that are not
    UTF-8 (400), and hands the app a receive that replays the body and then reports the
    client's disconnect as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body exceeds the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        # Past the limit the rest is read and dropped (up to a bound), so that the client,
        # still sending, gets to read the 413 instead of a reset connection.
        drain_to = self.max_bytes + DRAIN_BYTES
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > drain_to):
            await too_large.response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size <= self.max_bytes:
                chunks.append(body)
            if not message.get("more_body", False) or size > drain_to:
                break
        if size > self.max_bytes:
            await too_large.response()(scope, receive, send)
            return
        data = b"".join(chunks)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            err = APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})")
            await err.response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
