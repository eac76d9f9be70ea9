"""One streaming request against an OpenAI-compatible server (`/v1/completions`, or
`/v1/chat/completions` for a chat request), timed per server-sent event."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pagedserve.cli.bench.workload import BenchRequest


@dataclass
class RequestResult:
    """What one request saw. Times are seconds; `chunk_times` are offsets from `start`."""

    ok: bool
    prompt_tokens: int
    max_tokens: int
    start: float = 0.0  # perf_counter at send; run_rate makes it seconds after the run began
    ttft: float = 0.0  # first content chunk
    latency: float = 0.0  # last byte
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token output."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks (one chunk per token when streaming)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def request_path(req: BenchRequest) -> str:
    return "/v1/chat/completions" if req.chat is not None else "/v1/completions"


def request_body(req: BenchRequest, model: str, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.chat is not None:
        body["messages"] = [{"role": "user", "content": req.chat}]
    else:
        body["prompt"] = req.prompt
    return body


def _has_content(choice: dict[str, Any]) -> bool:
    """A chunk that carries output: any completion chunk, a chat delta with content (a chat
    stream opens with a role-only delta and may close with an empty one)."""
    if "delta" in choice:
        return bool(choice["delta"].get("content"))
    return True


class Response:
    """An HTTP/1.1 response read off a StreamReader: the status, the headers, then the body in
    the pieces the server framed it in (chunked, by Content-Length, or to the end)."""

    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self._reader = reader
        self.status = status
        self.headers = headers

    @classmethod
    async def read_head(cls, reader: asyncio.StreamReader) -> Response:
        line = await reader.readline()
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {line[:80]!r}")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return cls(reader, int(parts[1]), headers)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunk framing removed)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            buf = bytearray()
            while True:
                while (i := buf.find(b"\r\n")) < 0:
                    if not (data := await self._reader.read(_READ)):
                        raise ValueError("the connection closed inside a chunked body")
                    buf += data
                size = int(bytes(buf[:i]).split(b";", 1)[0], 16)
                if size == 0:
                    return
                end = i + 2 + size
                while len(buf) < end + 2:
                    if not (data := await self._reader.read(_READ)):
                        raise ValueError("the connection closed inside a chunk")
                    buf += data
                yield bytes(buf[i + 2 : end])
                del buf[: end + 2]
        elif (length := self.headers.get("content-length")) is not None:
            left = int(length)
            while left > 0 and (data := await self._reader.read(min(left, _READ))):
                left -= len(data)
                yield data
        else:
            while data := await self._reader.read(_READ):
                yield data


_READ = 1 << 16


async def post(
    base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[asyncio.StreamWriter, Response]:
    """POSTs `body` as JSON to base_url + path on a connection of its own (closed by the
    server after the response; the caller closes the writer) and reads the response's head."""
    url = urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    tls = url.scheme == "https"
    reader, writer = await asyncio.open_connection(
        url.hostname,
        url.port or (443 if tls else 80),
        ssl=ssl.create_default_context() if tls else None,
        limit=_READ,
    )
    try:
        data = json.dumps(body).encode()
        head = [
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1",
            f"Host: {url.netloc}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(data)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
        return writer, await Response.read_head(reader)
    except BaseException:
        writer.close()
        raise


async def sse_payloads(resp: Response) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream, in order, up to `[DONE]`; events may
    be split over the body's pieces or share one, with LF or CRLF line ends."""
    pending = b""
    async for piece in resp.body():
        pending += piece.replace(b"\r\n", b"\n")
        *events, pending = pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    yield payload


async def send(
    base_url: str,
    req: BenchRequest,
    model: str,
    ignore_eos: bool = True,
    headers: dict[str, str] | None = None,
    timeout_s: float = 3600.0,
) -> RequestResult:
    """POSTs one streaming completion and reads the SSE stream to its end, timing each event
    as it is parsed. The client is a bare HTTP/1.1 one, a connection per request: a load
    generator shares the machine with what it measures, and every cycle it spends per token
    is taken from the server."""
    res = RequestResult(ok=False, prompt_tokens=len(req.prompt), max_tokens=req.max_tokens)
    res.start = time.perf_counter()
    counted = 0
    usage_tokens: int | None = None
    writer: asyncio.StreamWriter | None = None
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            writer, resp = await post(
                base_url, request_path(req), request_body(req, model, ignore_eos), headers
            )
            if resp.status != 200:
                text = b"".join([piece async for piece in resp.body()])
                res.error = f"HTTP {resp.status}: {text.decode(errors='replace')[:300]}"
                return res
            async for payload in sse_payloads(resp):
                deadline.reschedule(loop.time() + timeout_s)
                now = time.perf_counter() - res.start
                chunk = json.loads(payload)
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    usage_tokens = int(usage.get("completion_tokens", 0))
                    res.prompt_tokens = int(usage.get("prompt_tokens", res.prompt_tokens))
                if any(_has_content(c) for c in chunk.get("choices") or ()):
                    if not res.chunk_times:
                        res.ttft = now
                    res.chunk_times.append(now)
                    counted += 1
        res.latency = time.perf_counter() - res.start
        res.output_tokens = usage_tokens if usage_tokens is not None else counted
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "the stream carried no tokens"
    except TimeoutError:
        res.error = f"no byte from the server for {timeout_s:g} s"
    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if writer is not None:
            writer.close()
    return res
