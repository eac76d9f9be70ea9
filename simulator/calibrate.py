"""Fitting a device profile to measured step times.

Given steps whose shapes (`StepShape`) and durations were measured on a real worker, find the
constants of `CostModel.step_time` that predict them best: the effective FLOP/s and bytes/s
of the roofline (peak x efficiency, so efficiency is stored as 1), the attention's FLOP/s, the
fixed overhead per step, and the costs per row and per token. The roofline's max() makes the
fit nonlinear: FLOP/s and bytes/s are searched on a log grid, and for each pair the four
linear constants (overhead, per row, per token, seconds per attention FLOP) are solved by
least squares (non-negative, relative error). `benchmarks/calibrate_simulator.py`
measures the steps and writes the profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pagedserve.plan import StepShape
from simulator.cost import CostModel, DeviceProfile
from simulator.hardware import ModelShape


def _features(cost: CostModel, shapes: Sequence[StepShape]) -> tuple[np.ndarray, np.ndarray]:
    """Per step: the roofline's FLOPs and bytes, at unit rates."""
    unit = replace(
        cost.profile,
        peak_flops=1.0,
        bandwidth=1.0,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        attention_efficiency=float("inf"),
        overhead_s=0.0,
        per_row_s=0.0,
        per_token_s=0.0,
    )
    flops = CostModel(replace(unit, bandwidth=float("inf")), cost.model, cost.tp, cost.block_size)
    nbytes = CostModel(replace(unit, peak_flops=float("inf")), cost.model, cost.tp, cost.block_size)
    return (
        np.array([flops.step_time(s) for s in shapes]),
        np.array([nbytes.step_time(s) for s in shapes]),
    )


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, by dropping negative coefficients until none is left."""
    keep = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sol >= 0).all():
            x[keep] = sol
            return x
        keep = [k for k, v in zip(keep, sol, strict=True) if v > 0]
    return x


def fit_profile(
    name: str,
    model: ModelShape,
    samples: Sequence[tuple[StepShape, float]],
    memory_bytes: int,
    block_size: int = 16,
    groups: Sequence[int] | None = None,
) -> tuple[DeviceProfile, float]:
    """The profile that best predicts `samples` (shape, seconds), and its median relative
    error. With `groups` (one label per sample), each group weighs the same in the fit,
    however many steps it ran."""
    keep = [i for i, (s, _) in enumerate(samples) if s.tokens]
    shapes = [samples[i][0] for i in keep]
    y = np.array([samples[i][1] for i in keep])
    if len(y) < 4:
        raise ValueError("at least 4 steps with tokens are needed to fit a profile")
    base = DeviceProfile(name, 1.0, 1.0, memory_bytes, 1e12, 1e12)
    flops, nbytes = _features(CostModel(base, model, 1, block_size), shapes)
    attn_flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim
    lin = np.stack(
        [
            np.ones(len(y)),
            np.array([s.rows for s in shapes]),
            np.array([s.tokens for s in shapes]),
            np.array([s.attention_pairs * attn_flops_per_pair for s in shapes]),
        ],
        axis=1,
    )
    w = 1.0 / y  # relative error
    if groups is not None:
        labels = [groups[i] for i in keep]
        sizes = {g: labels.count(g) for g in set(labels)}
        w = w / np.sqrt(np.array([sizes[g] for g in labels]))

    def search(fs: np.ndarray, bs: np.ndarray) -> tuple[float, float, float, np.ndarray]:
        best: tuple[float, float, float, np.ndarray] | None = None
        for f in fs:
            for b in bs:
                roof = np.maximum(flops / f, nbytes / b)
                x = _nonneg_lstsq(lin * w[:, None], (y - roof) * w)
                err = float(np.sum((((lin @ x + roof) / y - 1) * w * y) ** 2))
                if best is None or err < best[0]:
                    best = (err, float(f), float(b), x)
        assert best is not None
        return best

    # A coarse grid over six and five decades, then a fine one around its best point.
    _, f, b, _ = search(np.logspace(9, 15, 49), np.logspace(8, 13, 41))
    _, f, b, x = search(np.geomspace(f / 1.4, f * 1.4, 25), np.geomspace(b / 1.4, b * 1.4, 25))
    profile = DeviceProfile(
        name,
        peak_flops=f,
        bandwidth=b,
        memory_bytes=memory_bytes,
        link_bandwidth=1e12,
        host_bandwidth=1e12,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        # x[3] is seconds per attention FLOP; none means attention costs nothing measurable.
        attention_efficiency=float(1.0 / (x[3] * f)) if x[3] > 0 else 1e9,
        overhead_s=float(x[0]),
        per_row_s=float(x[1]),
        per_token_s=float(x[2]),
    )
    cost = CostModel(profile, model, 1, block_size)
    pred = np.array([cost.step_time(s) for s in shapes])
    return profile, float(np.median(np.abs(pred / y - 1)))
