"""`--plot`: latency CDFs per request rate, and throughput and latency against the rate.

A sweep gives a 2x2 figure: CDFs of TTFT and TPOT (ms) and of end-to-end latency (s), and a
panel of output tok/s (left axis) and mean TTFT and TPOT (ms, right axis) by rate. The rate
axis is linear; the "all at once" run (rate inf) sits one step past the highest finite rate,
under its own tick label. A single run has no rate panel: its three CDFs stand in a row, with
its throughput and mean latencies in the title.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ALL_AT_ONCE = "all at once"
# (key in each request's record, axis label, scale from seconds)
CDFS = (
    ("ttft_s", "time to first token (ms)", 1e3),
    ("tpot_s", "time per output token (ms)", 1e3),
    ("latency_s", "end-to-end latency (s)", 1.0),
)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def rate_label(rate: float | str) -> str:
    """'inf' -> 'all at once', 4.0 -> '4 req/s'."""
    return ALL_AT_ONCE if rate == "inf" else f"{float(rate):g} req/s"


def build_figure(report: dict[str, Any]) -> Figure:
    """The figure of a `bench serve` report (see the module docstring)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from exc

    runs = report["runs"]
    title = f"pagedserve bench serve: {report.get('model', '')}"
    if len(runs) == 1:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        cdf_axes = list(axes)
        r = runs[0]
        title += (
            f", {rate_label(r['request_rate'])}: {r['output_throughput']:.0f} output tok/s, "
            f"mean TTFT {r['ttft']['mean_ms']:.0f} ms, mean TPOT {r['tpot']['mean_ms']:.1f} ms"
        )
    else:
        fig, grid = plt.subplots(2, 2, figsize=(12, 8.5))
        cdf_axes = list(grid.flat[:3])
        _rate_panel(grid.flat[3], runs)
    for ax, (key, label, scale) in zip(cdf_axes, CDFS, strict=True):
        for run in runs:
            vals = [q[key] * scale for q in run["requests"] if q["ok"] and q[key] is not None]
            if vals:
                ax.plot(*_cdf(vals), label=rate_label(run["request_rate"]))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small", title="request rate", title_fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _rate_panel(ax: Axes, runs: list[dict[str, Any]]) -> None:
    """Output tok/s on the left axis, mean TTFT and TPOT (ms) on the right, by rate."""
    finite = sorted((r for r in runs if r["request_rate"] != "inf"), key=_rate)
    at_once = [r for r in runs if r["request_rate"] == "inf"]
    xs = [_rate(r) for r in finite]
    top = max(xs, default=0.0)
    # A linear axis from 0; "all at once" one step (a fifth of the range, at least 1) past the
    # highest finite rate, its line dotted: no rate lies between.
    inf_x = top + max(top / 5, 1.0)
    ordered = finite + at_once[:1]
    points = xs + [inf_x] * len(at_once[:1])
    right = ax.twinx()
    series = [
        (ax, "output tok/s", lambda r: r["output_throughput"], "o", "tab:blue"),
        (right, "mean TTFT (ms)", lambda r: r["ttft"]["mean_ms"], "s", "tab:red"),
        (right, "mean TPOT (ms)", lambda r: r["tpot"]["mean_ms"], "^", "tab:orange"),
    ]
    handles = []
    for axis, label, value, marker, color in series:
        ys = [value(r) for r in ordered]
        (h,) = axis.plot(points[: len(xs)], ys[: len(xs)], marker=marker, color=color, label=label)
        if at_once:
            if xs:
                axis.plot(points[-2:], ys[-2:], ":", color=color)
            axis.plot([inf_x], [ys[-1]], marker=marker, color=color, linestyle="none")
        handles.append(h)
    ticks = [t for t in ax.xaxis.get_major_locator().tick_values(0, top or 1.0) if 0 <= t <= top]
    labels = [f"{t:g}" for t in ticks]
    if at_once:
        ticks.append(inf_x)
        labels.append(ALL_AT_ONCE.replace(" ", "\n", 1))
    ax.set_xscale("linear")
    ax.set_xticks(ticks, labels)
    ax.set_xlim(0, inf_x * 1.05 if at_once else top * 1.05)
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    right.set_ylabel("mean latency (ms)")
    ax.grid(alpha=0.3)
    # Under the panel: inside, it would hide a point of one axis or the other.
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize="small"
    )
    ax.set_title("throughput and latency by rate")


def _rate(run: dict[str, Any]) -> float:
    return float(run["request_rate"])


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Saves build_figure(report) as a PNG at `path`."""
    fig = build_figure(report)
    import matplotlib.pyplot as plt  # after build_figure chose the Agg backend

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
