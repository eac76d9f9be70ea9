"""Summaries, tables and plots of simulation runs.

Throughput comes two ways. `request_throughput` / `output_throughput` divide the whole run,
drain included, as `bench serve` does (what `benchmarks/simulator_validation.py` compares). The
table's req/s and out tok/s are the steady ones: what finished over the second half of the
arrivals, once the first half has filled the cluster and before the drain after the last
arrival, when fewer and fewer requests run. Under the cluster's capacity they match the offered
rate; above it they are the capacity. Whole-run figures read below the offered rate even
unsaturated, by as much as the drain (the longest requests' latency) is long against the run.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pagedserve.latency import distribution
from simulator.cluster import SimResult


def steady_window(res: SimResult) -> tuple[float, float] | None:
    """The second half of the arrivals, [middle, last arrival]: None when arrivals take no
    time (a burst: then the run is all drain) or nothing finishes within it."""
    if not res.records:
        return None
    first = min(r.arrival for r in res.records)
    last = max(r.arrival for r in res.records)
    middle = (first + last) / 2
    within = any(r.finish is not None and middle < r.finish <= last for r in res.records)
    return (middle, last) if last > middle and within else None


def summarize(res: SimResult) -> dict[str, Any]:
    sim = res.sim
    done = [r for r in res.records if r.finish is not None]
    start = min((r.arrival for r in res.records), default=0.0)
    span = max(res.end_s - start, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    window = steady_window(res)
    if window is None:
        steady_s, steady_done, steady_tokens = span, len(done), out_tokens
    else:
        lo, hi = window
        finished = [r for r in done if r.finish is not None and lo < r.finish <= hi]
        steady_s, steady_done = hi - lo, len(finished)
        steady_tokens = sum(r.output_tokens for r in finished)
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    e2e = [r.finish - r.arrival for r in done if r.finish is not None]
    tpot = [
        (r.finish - r.first_token) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1 and r.finish is not None and r.first_token is not None
    ]
    norm = [(r.finish - r.arrival) / r.output_tokens for r in done if r.finish is not None]
    queue = [r.scheduled - r.arrival for r in done if r.scheduled is not None]
    stats = [w.scheduler.stats() for w in res.workers]
    busy = sum(w.stats.busy_s for w in res.workers)
    kv = [p for w in res.workers for p in w.stats.kv_series]
    query_tokens = sum(s.prefix_cache.num_query_tokens for s in stats)
    hit_tokens = sum(s.prefix_cache.num_hit_tokens for s in stats)
    idx = sim.index
    cp_load = sim.cp_cpu_s / span
    return {
        "num_requests": len(res.records),
        "completed": len(done),
        "rejected": sum(r.rejected for r in res.records),
        "duration_s": span,
        # The whole run, drain included, as `bench serve` counts.
        "request_throughput": len(done) / span,
        "output_throughput": out_tokens / span,
        # Over the second half of the arrivals (the whole run after a burst): the table's.
        "steady_window_s": list(window) if window is not None else None,
        "steady_request_throughput": steady_done / steady_s,
        "steady_output_throughput": steady_tokens / steady_s,
        "prompt_tokens": sum(len(r.req.prompt_ids) for r in done),
        "output_tokens": out_tokens,
        "ttft": distribution(ttft),
        "tpot": distribution(tpot),
        "e2e": distribution(e2e),
        "normalized_latency_s_per_token": statistics.fmean(norm) if norm else 0.0,
        "queueing": distribution(queue),
        # Plans sent, as the control plane counts steps (EngineLoop.counters.num_steps).
        "num_steps": sum(w.stats.steps for w in res.workers),
        "num_token_steps": sum(s.num_steps for s in stats),
        "num_empty_steps": sum(w.stats.empty_steps for w in res.workers),
        "mean_rows_per_step": sum(w.stats.rows for w in res.workers)
        / max(1, sum(w.stats.steps - w.stats.empty_steps for w in res.workers)),
        "num_preemptions": sum(s.num_preemptions for s in stats),
        "num_preemptions_recompute": sum(s.num_preemptions_recompute for s in stats),
        "num_preemptions_swap": sum(s.num_preemptions_swap for s in stats),
        "mean_batch_size": sum(w.stats.row_seconds for w in res.workers) / busy if busy else 0.0,
        "worker_busy_frac": busy / (span * len(res.workers)),
        "kv_blocks_held_mean": statistics.fmean(p[1] for p in kv) if kv else 0.0,
        "kv_tokens_used_mean": statistics.fmean(p[2] for p in kv) if kv else 0.0,
        "num_gpu_blocks_per_worker": sim.num_gpu_blocks,
        "prefix_hit_rate": hit_tokens / query_tokens if query_tokens else 0.0,
        "routed_with_prefix_hit": sim.router.counters.num_routed_with_prefix_hit,
        "prefix_index": {
            "lookups_per_s": idx.lookups / span,
            "updates_per_s": idx.updates / span,
            "ops_per_s": (idx.lookups + idx.updates) / span,
            "hashes_per_s": (idx.lookup_hashes + idx.update_hashes) / span,
            "peak_entries": idx.peak_entries,
            "peak_keys": idx.peak_keys,
        },
        "control_plane": {
            "cpu_s": sim.cp_cpu_s,
            "cpu_per_step_us": sim.cp_cpu_s / max(1, sim.cp_steps) * 1e6,
            "load_cores": cp_load,
            "workers_per_process": len(res.workers) / cp_load if cp_load else float("inf"),
        },
        "wall_s": res.wall_s,
        "kv_series": [
            {
                "worker": w.index,
                "t": [p[0] for p in w.stats.kv_series],
                "held": [p[1] for p in w.stats.kv_series],
                "used": [p[2] for p in w.stats.kv_series],
            }
            for w in res.workers[:4]
        ],
    }


HEADERS = [
    "allocation",
    "routing",
    "rate",
    "done",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "norm s/tok",
    "batch",
    "preempt",
    "steps",
    "prefix hit",
    "wall s",
]


STEADY_NOTE = (
    "req/s, out tok/s: finished per second over the second half of the arrivals (the drain "
    "after the last one left out): the offered rate unless the cluster is saturated"
)


def table_row(run: dict[str, Any]) -> list[Any]:
    s = run["summary"]
    return [
        run["allocation"],
        run["routing"],
        run["rate"],
        s["completed"],
        f"{s['steady_request_throughput']:.2f}",
        f"{s['steady_output_throughput']:.0f}",
        f"{s['ttft']['p50_ms']:.0f} ms",
        f"{s['ttft']['p99_ms']:.0f} ms",
        f"{s['tpot']['p50_ms']:.1f} ms",
        f"{s['tpot']['p99_ms']:.1f} ms",
        f"{s['normalized_latency_s_per_token']:.3f}",
        f"{s['mean_batch_size']:.1f}",
        s["num_preemptions"],
        s["num_steps"],
        f"{s['prefix_hit_rate'] * 100:.1f}%",
        f"{s['wall_s']:.1f}",
    ]


def format_table(runs: list[dict[str, Any]]) -> str:
    rows = [HEADERS] + [[str(c) for c in table_row(r)] for r in runs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(STEADY_NOTE)
    return "\n".join(lines)


def sustained_rate(runs: list[dict[str, Any]], threshold_s_per_token: float) -> float | None:
    """The highest swept rate whose mean normalized latency stays within the threshold (and
    every rate below it does too)."""
    best = None
    for run in sorted(runs, key=lambda r: float(r["rate"])):
        if run["summary"]["normalized_latency_s_per_token"] > threshold_s_per_token:
            break
        best = float(run["rate"])
    return best


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """latency_vs_rate.png (normalized latency per policy, as the PagedAttention paper's
    Fig. 12) and kv_utilization.png (the first run's KV use over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    runs = report["runs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    policies: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        policies.setdefault(f"{r['allocation']} / {r['routing']}", []).append(r)
    for label, rs in policies.items():
        rs = sorted(rs, key=lambda r: float(r["rate"]))
        ax.plot(
            [float(r["rate"]) for r in rs],
            [r["summary"]["normalized_latency_s_per_token"] for r in rs],
            marker="o",
            label=label,
        )
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{report['model']} on {report['device']} x{report['workers']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "latency_vs_rate.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs[: min(4, len(runs))]:
        series = r["summary"]["kv_series"][0] if r["summary"]["kv_series"] else None
        if series:
            label = f"{r['allocation']} @ {r['rate']}"
            ax.plot(series["t"], [v * 100 for v in series["held"]], label=f"{label}: held")
            ax.plot(series["t"], [v * 100 for v in series["used"]], "--", label=f"{label}: used")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV cache of worker 0 (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "kv_utilization.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
