"""`pagedserve bench serve`: drive a running server's OpenAI API and report latencies.

For each request rate: requests arrive as a Poisson process (exponential gaps), in bursts of
`burst_size` (the same mean rate), or all at once (rate `inf`); at most `max_concurrency` are
in flight. Each request streams (`stream: true`) so that time to first token and the gaps
between tokens are seen as a client sees them.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from pagedserve.cli.bench.client import RequestResult, send
from pagedserve.cli.bench.metrics import summarize
from pagedserve.cli.bench.workload import BenchRequest

Arrival = Literal["poisson", "burst"]


class BenchError(RuntimeError):
    """The server cannot be benchmarked: nothing answers, it refuses the API key, it serves no
    model, or the warm-up request fails. The message is one line for the user."""


@dataclass(frozen=True)
class ServeConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    request_rates: tuple[float, ...] = (math.inf,)
    arrival: Arrival = "poisson"
    burst_size: int = 8
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    num_warmup: int = 1
    progress: bool = True
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.request_rates or any(r <= 0 for r in self.request_rates):
            raise ValueError("request rates must be > 0 (inf: all at once)")
        if self.arrival not in ("poisson", "burst"):
            raise ValueError(f"arrival must be poisson or burst, got {self.arrival!r}")
        if self.burst_size < 1:
            raise ValueError("burst_size must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None


def arrival_times(n: int, rate: float, arrival: Arrival, burst_size: int, seed: int) -> list[float]:
    """Seconds after the start at which each of n requests is sent."""
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "burst":
        return [(i // burst_size) * burst_size / rate for i in range(n)]
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or when forced)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def update(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            width = 30
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def resolve_model(client: httpx.AsyncClient, cfg: ServeConfig) -> str:
    """`cfg.model`, else the first model the server lists. Asking the server even when the
    model is given checks that it answers and takes the key before any load is sent."""
    url = cfg.base_url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=cfg.headers)
    except httpx.TransportError as exc:
        raise BenchError(
            f"no server answers at {cfg.base_url} ({exc or type(exc).__name__}): start one "
            "with `pagedserve up`, or point --base-url at it"
        ) from None
    if resp.status_code in (401, 403):
        if cfg.api_key:
            raise BenchError(f"{cfg.base_url} refused the API key (HTTP {resp.status_code})")
        raise BenchError(
            f"{cfg.base_url} requires an API key (HTTP {resp.status_code}): pass --api-key "
            "or set PAGEDSERVE_API_KEY"
        )
    if cfg.model:
        return cfg.model
    if resp.status_code != 200:
        raise BenchError(f"GET {url}: HTTP {resp.status_code}: {_error_message(resp)}")
    models = resp.json().get("data") or []
    if not models:
        raise BenchError(f"{cfg.base_url} serves no models")
    return str(models[0]["id"])


def _error_message(resp: httpx.Response) -> str:
    """An OpenAI-style error's message, else the start of the body."""
    try:
        return str(resp.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


async def run_rate(
    cfg: ServeConfig,
    model: str,
    requests: Sequence[BenchRequest],
    rate: float,
) -> tuple[list[RequestResult], float]:
    """Sends every request on its schedule; returns the results and the run's duration."""
    times = arrival_times(len(requests), rate, cfg.arrival, cfg.burst_size, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    progress = Progress(len(requests), f"rate {rate:g}", cfg.progress)

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:
            res = await send(cfg.base_url, req, model, cfg.ignore_eos, cfg.headers, cfg.timeout_s)
        progress.update()
        return res

    start = time.perf_counter()
    tasks = []
    for req, at in zip(requests, times, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    for r in results:
        r.start -= start  # seconds after the run's start at which it was sent
    return results, time.perf_counter() - start


async def run(cfg: ServeConfig, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Warm-up, then one run per request rate; the report (summaries and per-request data)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
        model = await resolve_model(client, cfg)
    for req in requests[: cfg.num_warmup]:
        warm = await send(
            cfg.base_url,
            BenchRequest(req.prompt[:16], 4, req.chat),
            model,
            cfg.ignore_eos,
            cfg.headers,
            cfg.timeout_s,
        )
        if not warm.ok:
            raise BenchError(f"the warm-up request failed: {warm.error}")
    runs = []
    for rate in cfg.request_rates:
        results, duration = await run_rate(cfg, model, requests, rate)
        runs.append(
            {
                "request_rate": rate if math.isfinite(rate) else "inf",
                **summarize(results, duration),
                "requests": [
                    {
                        "arrival_s": r.start,
                        "prompt_tokens": r.prompt_tokens,
                        "output_tokens": r.output_tokens,
                        "ttft_s": r.ttft,
                        "latency_s": r.latency,
                        "tpot_s": r.tpot,
                        "ok": r.ok,
                    }
                    for r in results
                ],
            }
        )
    return {"model": model, "runs": runs}
