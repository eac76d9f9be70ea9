"""One streaming request against an OpenAI-compatible server (`/v1/completions`, or
`/v1/chat/completions` for a chat request), timed per chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedserve.bench.workload import BenchRequest


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


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    req: BenchRequest,
    model: str,
    ignore_eos: bool = True,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POSTs one streaming completion and reads the SSE stream to its end."""
    res = RequestResult(ok=False, prompt_tokens=len(req.prompt), max_tokens=req.max_tokens)
    res.start = time.perf_counter()
    counted = 0
    usage_tokens: int | None = None
    try:
        body = request_body(req, model, ignore_eos)
        url = base_url.rstrip("/") + request_path(req)
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - res.start
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"].get("completion_tokens", 0))
                    res.prompt_tokens = int(chunk["usage"].get("prompt_tokens", res.prompt_tokens))
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
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res
