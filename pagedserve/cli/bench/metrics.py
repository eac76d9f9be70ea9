"""Latency and throughput summaries of a benchmark run (the figures vLLM's serving benchmark
reports): TTFT, TPOT, ITL and end-to-end latency as mean/p50/p90/p99, request and token
throughput."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.cli.bench.client import RequestResult
from pagedserve.latency import distribution


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [g for r in ok for g in r.itls]
    errors = [r.error for r in results if not r.ok and r.error]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:10],
        "duration_s": duration_s,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution(tpots),
        "itl": distribution(itls),
        "e2e": distribution([r.latency for r in ok]),
    }
