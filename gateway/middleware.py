"""Pure ASGI middleware (streaming-safe): request ids and access logs, HEAD, API keys, body
limits.

Order, outermost first: RequestContext (so every response carries `x-request-id`, errors
included), HeadAsGet, ApiKeyAuth (reject before reading a body), BodyLimit (read the body once,
bounded).
"""

from __future__ import annotations

import asyncio
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
# After a 413 the connection is closed. Until then what the client is still sending is read
# and dropped (a lingering close, as nginx's lingering_close): a client that reads only once
# it has written its body (Python's http.client, requests) then finds the 413, not a
# connection reset, which closing on unread data makes the kernel send. Bounded: at most
# LINGER_BYTES, LINGER_S in all, and LINGER_IDLE_S without data (a client that stopped).
LINGER_S = 5.0
LINGER_IDLE_S = 1.0
LINGER_BYTES = 16 << 20


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


class HeadAsGet:
    """HEAD on any route answers as GET does (status and headers) without the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


# What answers without the key: probes, which cannot send one.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every path but OPEN_PATHS: the API, and what describes
    it (/docs, /redoc, /openapi.json); a path that serves nothing is a 401 too, not a 404
    telling which exist."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
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
    """Reads a request body once, up to `max_bytes`, rejects bodies that are not UTF-8 (400),
    and hands the app a receive that replays the body and then reports the client's
    disconnect as usual.

    Past the limit the answer is 413 at once: before reading anything when Content-Length
    says so, as soon as the bytes read pass it for a chunked body. The connection is then
    closed after a bounded linger (see `_too_large`), so a client can never make the gateway
    read more than the limit plus LINGER_BYTES.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
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

    async def _too_large(
        self, scope: Scope, receive: Receive, send: Send, more_body: bool = True
    ) -> None:
        """Sends the whole 413 now, lingers (bounded) over the rest of the body, then ends the
        response with `Connection: close`, which makes the server close the connection."""
        err = APIError(
            413,
            f"the request body exceeds the limit of {self.max_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )

        async def send_open(message: Message) -> None:
            # The body goes out in full; only the end of the response waits for the linger.
            if message["type"] == "http.response.body":
                message = {**message, "more_body": True}
            await send(message)

        await err.response()(scope, receive, send_open)
        # A client waiting for `100 Continue` has sent nothing: there is nothing to linger over.
        if more_body and _header(scope, b"expect") is None:
            await _discard_body(receive, LINGER_BYTES, LINGER_S, LINGER_IDLE_S)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard_body(receive: Receive, max_bytes: int, timeout_s: float, idle_s: float) -> None:
    """Reads and drops request body messages until the body ends, max_bytes are read,
    timeout_s has passed, or nothing came for idle_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    read = 0
    while read <= max_bytes:
        wait = min(idle_s, deadline - loop.time())
        if wait <= 0:
            return
        try:
            async with asyncio.timeout(wait):
                message = await receive()
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        read += len(message.get("body", b""))
