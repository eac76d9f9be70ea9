"""`--plot`: latency CDFs per request rate, and throughput and latency against the rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def write_plot(report: dict[str, Any], path: Path) -> None:
    """A 2x2 PNG: CDFs of TTFT, TPOT and end-to-end latency; output tok/s and mean TTFT by rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from exc

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft_s", "time to first token (s)"), ("tpot_s", "time per output token (s)")]
    panels.append(("latency_s", "end-to-end latency (s)"))
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for run in report["runs"]:
            vals = [r[key] for r in run["requests"] if r["ok"] and r[key] is not None]
            if vals:
                ax.plot(*_cdf(vals), label=f"rate {run['request_rate']}")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")

    ax = axes.flat[3]
    finite = [r for r in report["runs"] if r["request_rate"] != "inf"]
    inf_runs = [r for r in report["runs"] if r["request_rate"] == "inf"]
    rates = [float(r["request_rate"]) for r in finite]
    if inf_runs:
        # Plot "all at once" just past the highest finite rate, labelled as such.
        rates.append(max(rates) * 2 if rates else 1.0)
    runs = finite + inf_runs
    ax.plot(rates, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax.set_xlabel("request rate (req/s)" + (", last point: all at once" if inf_runs else ""))
    ax.set_ylabel("output tokens/s")
    if rates and all(r > 0 for r in rates) and len(rates) > 1:
        ax.set_xscale("log")
    ax2 = ax.twinx()
    ax2.plot(rates, [r["ttft"]["mean_ms"] for r in runs], "s--", color="tab:red", label="mean TTFT")
    ax2.set_ylabel("mean TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.set_title("throughput and latency by rate")
    fig.suptitle(f"pagedserve bench serve: {report.get('model', '')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
