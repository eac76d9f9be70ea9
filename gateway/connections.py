"""The HTTP/1.1 connections under the app: uvicorn's httptools protocol (llhttp, in C) with
deadlines on reading a request, a cap on a request's head, a cap on open connections and a
bound on how long an answer may wait for a client that reads none of it.

Uvicorn (0.54) has none of them: its keep-alive timeout starts only after a response, so a
client that connects and sends nothing, or sends its headers a byte at a time, holds a socket
for ever; its httptools protocol takes headers of any size; and its `limit_concurrency` counts
every open connection against each request, so a crowd of idle sockets would turn away the
clients already connected.

    connection opened / previous response sent
      │ headers: ≤ header_timeout_s ── late: closed (408 if part of a request had come)
      │          ≤ MAX_HEAD_BYTES ──── more (however it arrives): 431, closed
      ▼
    request line and headers in
      │ body: ≤ body_timeout_s ──────── late: 408, closed
      ▼
    body in, the app answers (no deadline here: generation takes what it takes)

A connection opened while max_connections are open gets its request answered 503 with
Retry-After and is closed; the connections already open go on as before.

Writing: once what waits to be sent passes the transport's high-water mark (64 KiB), the
client has write_stall_timeout_s to take some of it. One that takes nothing has its
connection aborted, its unsent bytes dropped, and the app hears http.disconnect (which aborts
a request still generating). This holds whether the answer is still being made or already
whole: the app's own stall check (gateway.upstream.Inbox) sees only messages still to come,
and closing a connection with bytes unsent waits for them to drain, so without it a client
that stopped reading held its socket and its answer's bytes for as long as it kept the
connection open.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import APIError
from pagedserve.log import get_logger

log = get_logger(__name__)

# An over-limit connection's request body is read and dropped, this long and this much at
# most, so that a client still writing finds the 503 rather than a connection reset.
_DRAIN_S = 0.5
_DRAIN_BYTES = 1 << 20
# A request line and headers larger than this are refused (431).
MAX_HEAD_BYTES = 64 << 10


@dataclass(frozen=True)
class EdgeLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    retry_after_s: int
    write_stall_timeout_s: float = 60.0  # --stream-stall-timeout


class _Phase(enum.Enum):
    HEADERS = "headers"
    BODY = "body"


class _HeadTooLarge(Exception):
    """Raised from a parser callback: llhttp stops, and uvicorn calls send_400_response."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with read deadlines, a cap on a request's head and a connection cap;
    `limits` is set by `guarded_protocol`, which uvicorn's `http=` takes.

    What the connection waits for from the client follows the parser's callbacks: a request's
    head from the moment the connection opens or the last response is sent, until the head is
    parsed; then its body, until the message is complete; then nothing while the app answers.
    A request pipelined behind one still being answered waits without a deadline, as its
    reading is paused."""

    limits: ClassVar[EdgeLimits]

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._phase: _Phase | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # of the request whose head is being read
        self._head_parsed = 0  # its request target and headers the parser has handed over
        self._head_too_large = False
        self._body_done = True  # the last request's message was read to its end
        self._write_stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            _RefusalLog.refused(self.limits.max_connections)
            self.app = _over_capacity(self.limits)
        self._set_deadline(_Phase.HEADERS)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        self._unset_write_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport holds more unsent bytes than its high-water mark: the client has
        write_stall_timeout_s to take some (resume_writing) before it is cut off."""
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(
                self.limits.write_stall_timeout_s, self._write_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unset_write_stall()

    def _unset_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _write_stalled(self) -> None:
        self._write_stall = None
        state = self.cycle.scope.get("state", {}) if self.cycle is not None else {}
        log.warning(
            "http_write_stalled",
            request_id=state.get("request_id"),
            unsent_bytes=self.transport.get_write_buffer_size(),
            stall_timeout_s=self.limits.write_stall_timeout_s,
        )
        self._set_deadline(None)
        if self.cycle is not None:
            # The app hears http.disconnect; what it sends from now on is dropped.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.abort()  # close() would wait for the unsent bytes

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.HEADERS:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        # Still reading the head after this many bytes (what of them belonged to a body only
        # counts when the head ended in them, and then the phase has moved on).
        if self._phase is _Phase.HEADERS and self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()
        elif self._phase is None and self._body_done and not self.cycle.response_complete:
            # The next request sent while this one is answered: read no more of it until the
            # answer is sent (the parser holds what came, however large its head).
            self.flow.pause_reading()

    # Bytes read while the head is read cannot bound a head that arrives whole in one read (up
    # to 256 KiB): the parser is through it, and at its body, before they are counted. What
    # the parser hands over is counted as it comes instead.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_parsed = 0

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._body_done = False
        pipelined = bool(self.pipeline) and self.pipeline[0][0] is self.cycle
        self._set_deadline(None if pipelined else _Phase.BODY)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._body_done = True
        if self._phase is _Phase.BODY:
            if self.cycle.response_complete:  # answered early: the next request may come
                self._await_next()
            else:
                self._set_deadline(None)

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if pipelined:
            # The next request starts now; the last of those queued may still owe its body.
            owed = not self._body_done and not self.pipeline
            self._set_deadline(_Phase.BODY if owed else None)
        else:
            self._await_next()

    def _await_next(self) -> None:
        """After a response: the next request's head, or the rest of this one's body if it was
        answered before it was read (a 401 does not read it)."""
        if self._body_done:
            self._head_bytes = 0
            self._set_deadline(_Phase.HEADERS)
        else:
            self._set_deadline(_Phase.BODY)

    def _set_deadline(self, phase: _Phase | None) -> None:
        self._phase = phase
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if phase is not None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self._limit(phase), self._timed_out, phase)

    def _limit(self, phase: _Phase) -> float:
        if phase is _Phase.HEADERS:
            return self.limits.header_timeout_s
        return self.limits.body_timeout_s

    def _timed_out(self, phase: _Phase) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if phase is _Phase.BODY or self._head_bytes:
            # A quiet connection is simply closed; a half-sent request hears why.
            timeout = self._limit(phase)
            log.info("http_read_timeout", part=phase.value, timeout_s=timeout)
            # Waiting for a body, the app may have answered already (a 401 does not read it).
            answered = (
                phase is _Phase.BODY and self.cycle is not None and self.cycle.response_started
            )
            if not answered:
                flag = "--http-header-timeout" if phase is _Phase.HEADERS else "--http-body-timeout"
                message = (
                    f"the request's {phase.value} did not arrive within {timeout:g} s ({flag})"
                )
                err = APIError(408, message, type="timeout_error", code="request_timeout")
                self.transport.write(_raw_response(err))
        self._close()

    def send_400_response(self, msg: str) -> None:
        """What the HTTP parser cannot read (a bad request line or header, a Content-Length
        that is no number, twice over or beside Transfer-Encoding, a bad chunk size): a 400 in
        OpenAI's error shape, as every other refusal, and the connection closed. A head past
        MAX_HEAD_BYTES stops the parser this way too: it gets its 431."""
        if self._head_too_large:
            self._refuse_head()
            return
        log.info("http_unparsable", detail=msg)
        message = "the request could not be parsed as HTTP/1.1 (request line, headers or framing)"
        err = APIError(400, message, code="invalid_http_request")
        self.transport.write(_raw_response(err))
        self._close()

    def _refuse_head(self) -> None:
        log.info("http_head_too_large", max_bytes=MAX_HEAD_BYTES)
        message = f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"
        code = "request_header_fields_too_large"
        self.transport.write(_raw_response(APIError(431, message, code=code)))
        self._close()

    def _close(self) -> None:
        self._set_deadline(None)
        if self.cycle is not None:
            # The app (waiting for the body) hears http.disconnect; what it sends is dropped.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()
        if self.transport.get_write_buffer_size() and self._write_stall is None:
            # Closing waits for the unsent bytes; bound that wait as a paused write's.
            self._write_stall = self.loop.call_later(
                self.limits.write_stall_timeout_s, self._write_stalled
            )


class _RefusalLog:
    """One warning a second at most under a flood, with the count since the last."""

    count = 0
    logged_at = 0.0

    @classmethod
    def refused(cls, max_connections: int) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls.logged_at >= 1.0:
            log.warning("connections_refused", count=cls.count, max_connections=max_connections)
            cls.count, cls.logged_at = 0, now


def guarded_protocol(limits: EdgeLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for uvicorn's `http=`, with these limits."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


def _raw_response(err: APIError) -> bytes:
    """`err` as a whole response that closes the connection, written below the protocol
    (which, with no request read whole, has nothing to answer)."""
    data = json.dumps(err.body(), separators=(",", ":")).encode()
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n"
        % (err.status, HTTPStatus(err.status).phrase.encode(), len(data))
    )
    return head + data


def _over_capacity(limits: EdgeLimits) -> Any:
    """The ASGI app that answers a connection over the cap."""
    err = APIError(
        503,
        f"the gateway has {limits.max_connections} connections open, its limit (--max-connections)",
        type="server_error",
        code="service_unavailable",
        headers={"Retry-After": str(limits.retry_after_s), "Connection": "close"},
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            async with asyncio.timeout(_DRAIN_S):
                read = 0
                while read <= _DRAIN_BYTES:
                    message = await receive()
                    read += len(message.get("body", b""))
                    if message["type"] != "http.request" or not message.get("more_body"):
                        break
        except TimeoutError:
            pass
        await err.response()(scope, receive, send)

    return app
