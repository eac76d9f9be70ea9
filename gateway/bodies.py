"""Request bodies: JSON parsed, validated and made into what the control plane takes, where
that work cannot stall other requests.

The work grows with the body: json.loads, the Unicode and depth walk, pydantic's validation
and the prompt's protobuf each visit every token id and message, mostly in Python (a 4 MB
list of 2 M token ids took seconds). On the event loop it shows as a gap as long in every
other client's stream. A body larger than OFF_LOOP_BYTES is handled on one worker thread
instead: CPython hands the GIL to the waiting loop every few milliseconds, so other streams
go on. Smaller bodies are handled inline, where the hop to a thread would cost more than the
work. One thread, so that large bodies queue behind each other rather than take the GIL from
the loop together.

The GIL changes hands only between Python bytecodes, and json.loads is C: 4 MB of token ids
held it for 185 ms. On the thread the JSON is decoded with a Python hook on every number and
object (`_YIELDING`), which lets the loop in between (the decoding takes about twice as
long; the loop waits milliseconds at most).

Counts are bounded before anything walks the body (`gateway.protocol`): a body past them
costs its json.loads and no more.

    body bytes ─▶ json.loads ─▶ counts ─▶ Unicode and depth ─▶ model ─▶ check() ─▶ prepare(model)
                  (400: JSON)  (400: too many ids / messages)  (400: a field) (400: rules)
"""

from __future__ import annotations

import asyncio
import contextvars
import email.message
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.errors import bad_request
from gateway.protocol import RequestBody
from pagedserve.log import get_logger

log = get_logger(__name__)

# Bodies up to this size are parsed on the event loop (a few milliseconds at most).
OFF_LOOP_BYTES = 16 << 10

_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-body")

B = TypeVar("B", bound=RequestBody)
P = TypeVar("P")


@dataclass(frozen=True)
class Parsed(Generic[B, P]):
    body: B
    prepared: P  # what the route's `prepare` made of it


async def read_body(request: Request, model: type[B], prepare: Callable[[B], P]) -> Parsed[B, P]:
    """The request's JSON body as `model`, its unknown fields logged and its cross-field rules
    checked (`check()`), and `prepare(body)`: all on the worker thread for a large body (with
    the request's log context), inline for a small one. Raises what FastAPI would for a body
    parameter (RequestValidationError, so the error reads the same) and whatever `check` and
    `prepare` raise (an APIError for a 400)."""
    data = await request.body()
    content_type = request.headers.get("content-type")
    if len(data) <= OFF_LOOP_BYTES:
        return _parse(model, data, content_type, prepare, json.loads)
    work = functools.partial(_parse, model, data, content_type, prepare, _yielding_loads)
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_PARSER, context.run, work)


def _parse(
    model: type[B],
    data: bytes,
    content_type: str | None,
    prepare: Callable[[B], P],
    loads: Callable[[bytes], Any],
) -> Parsed[B, P]:
    body = _validate(model, _json_value(data, content_type, loads))
    ignored = body.ignored_fields()
    if ignored:  # dropped, as vLLM does, with one line naming them
        log.warning("unknown_fields_ignored", fields=ignored)
    body.check()
    return Parsed(body, prepare(body))


def _python_int(text: str) -> int:
    return int(text)


def _python_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


# Decodes as json.loads does; its hooks are Python functions, so that the GIL can change hands.
_YIELDING = json.JSONDecoder(parse_int=_python_int, object_pairs_hook=_python_dict)


def _yielding_loads(data: bytes) -> Any:
    """json.loads(data), letting other threads (the event loop) run every few milliseconds."""
    return _YIELDING.decode(data.decode(json.detect_encoding(data), "surrogatepass"))


def _json_value(data: bytes, content_type: str | None, loads: Callable[[bytes], Any]) -> Any:
    """The body as FastAPI reads it for a JSON body parameter (strict_content_type off): JSON
    when the content type is missing or JSON, else the bytes themselves (which no model takes)."""
    if not data:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    if content_type is not None:
        message = email.message.Message()
        message["content-type"] = content_type
        subtype = message.get_content_subtype()
        json_type = message.get_content_maintype() == "application" and (
            subtype == "json" or subtype.endswith("+json")
        )
        if not json_type:
            return data
    try:
        return loads(data)
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": ("body", exc.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise RequestValidationError([error]) from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None


def _validate(model: type[B], value: Any) -> B:
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        errors = [
            {**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)
        ]
        raise RequestValidationError(errors) from None
