"""Latency distributions as vLLM's serving benchmark reports them: the mean and p50/p90/p99 in
milliseconds. `pagedserve bench serve` and `pagedserve simulate` report the same figures."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Milliseconds: mean and percentiles of values in seconds."""
    out = {"mean_ms": statistics.fmean(values) * 1e3 if values else 0.0}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = percentile(values, q) * 1e3
    return out
