"""Running one OpenAI generation request: the choices' upstream calls, the response (whole or
as server-sent events), and cancelling everything when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.choices import Choice, ChoiceEvent
from gateway.errors import APIError
from gateway.responses import ChoiceState, Format, usage
from pagedserve.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# 499: the client closed the connection (nginx's code); nobody reads this response.
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Awaits `aw`, cancelling it (and raising ClientGone) if the client disconnects first."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.wait({work})  # lets the cancelled work run its cleanup first
    raise ClientGone


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def respond(
    request: Request,
    events: AsyncGenerator[list[ChoiceEvent], None],
    choices: list[Choice],
    fmt: Format,
    n: int,
    stream: bool,
    include_usage: bool,
) -> Response:
    """The whole body, or an SSE stream whose first event is already in hand, so that an
    upstream rejection (400, 404, 429, 503) still becomes the response's HTTP status."""
    states = {i: ChoiceState() for c in choices for i in c.indices}
    try:
        if not stream:
            await until_disconnect(request, _collect(events, states))
            return JSONResponse(fmt.body(states, usage(states, n)))
        first = await until_disconnect(request, anext(events))
    except ClientGone:
        log.info("client_disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await events.aclose()
        raise
    body = _sse_body(
        first, events, states, fmt, n, include_usage, [i for c in choices for i in c.indices]
    )
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _collect(
    events: AsyncGenerator[list[ChoiceEvent], None], states: dict[int, ChoiceState]
) -> None:
    async for batch in events:
        for ev in batch:
            states[ev.index].add(ev)


async def _sse_body(
    first: list[ChoiceEvent],
    events: AsyncGenerator[list[ChoiceEvent], None],
    states: dict[int, ChoiceState],
    fmt: Format,
    n: int,
    include_usage: bool,
    indices: list[int],
) -> AsyncIterator[str]:
    """One write per engine step: the events of all the request's completions that came in it
    (the head chunks go with the first)."""
    try:
        parts = [sse(chunk) for chunk in fmt.head(indices)]
        batch: list[ChoiceEvent] | None = first
        while batch is not None:
            for ev in batch:
                states[ev.index].add(ev)
                data = fmt.chunk(ev)
                if data is not None:
                    parts.append(sse(data))
            if parts:
                yield "".join(parts)
                parts = []
            batch = await anext(events, None)
        if include_usage:
            yield sse(fmt.usage_chunk(usage(states, n)))
    except APIError as err:
        # Headers are gone: the error travels as an event, which OpenAI clients raise.
        log.info("stream_failed", status=err.status, reason=err.message)
        yield sse(err.body())
    except asyncio.CancelledError:
        log.info("client_disconnected")
        raise
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()
    yield "data: [DONE]\n\n"
