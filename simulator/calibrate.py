"""Fitting a device profile to measured step times.

Given steps whose shapes (`StepShape`) and durations were measured on a real worker, find the
constants of `CostModel.step_time` that predict them best: the effective FLOP/s and bytes/s
of the rooflines (peak x efficiency, so efficiency is stored as 1), attention's efficiency,
the fixed overhead per step, and the costs per row and per token. The rooflines' max() makes
the fit nonlinear: FLOP/s, bytes/s and attention's efficiency are searched on a log grid, and
for each point the three linear constants are solved by least squares (non-negative, relative
error). `benchmarks/calibrate_simulator.py`
measures the steps and writes the profile.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedserve.plan import StepShape
from simulator.cost import CostModel, DeviceProfile
from simulator.hardware import ModelShape


def _features(cost: CostModel, shapes: Sequence[StepShape]) -> dict[str, np.ndarray]:
    """Per step: the GEMMs' FLOPs, the weights' bytes, attention's FLOPs and its KV bytes."""
    m = cost.model
    per_token = 2 * m.num_layers * m.layer_params
    lm_head = 2 * m.hidden_size * m.vocab_size
    per_pair = 4 * m.num_layers * m.num_heads * m.head_dim
    return {
        "flops": np.array([per_token * s.tokens + lm_head * s.sampled_rows for s in shapes]),
        "weights": np.full(len(shapes), float(m.weight_bytes)),
        "attn_flops": np.array([per_pair * s.attention_pairs for s in shapes], dtype=float),
        "kv_bytes": np.array(
            [m.kv_bytes_per_token * (s.context_tokens + s.tokens) for s in shapes], dtype=float
        ),
    }


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
    feat = _features(CostModel(base, model, 1, block_size), shapes)
    lin = np.stack(
        [np.ones(len(y)), np.array([s.rows for s in shapes]), np.array([s.tokens for s in shapes])],
        axis=1,
    )
    w = 1.0 / y  # relative error
    if groups is not None:
        labels = [groups[i] for i in keep]
        sizes = {g: labels.count(g) for g in set(labels)}
        w = w / np.sqrt(np.array([sizes[g] for g in labels]))

    def search(
        fs: np.ndarray, bs: np.ndarray, effs: np.ndarray
    ) -> tuple[float, float, float, float, np.ndarray]:
        best: tuple[float, float, float, float, np.ndarray] | None = None
        for f in fs:
            gemm_c = feat["flops"] / f
            for b in bs:
                gemm = np.maximum(gemm_c, feat["weights"] / b)
                kv = feat["kv_bytes"] / b
                for e in effs:
                    roof = gemm + np.maximum(feat["attn_flops"] / (f * e), kv)
                    x = _nonneg_lstsq(lin * w[:, None], (y - roof) * w)
                    err = float(np.sum((((lin @ x + roof) / y - 1) * w * y) ** 2))
                    if best is None or err < best[0]:
                        best = (err, float(f), float(b), float(e), x)
        assert best is not None
        return best

    # A coarse grid over the decades, then a fine one around its best point.
    _, f, b, e, _ = search(
        np.logspace(9, 15, 31), np.logspace(8, 13, 26), np.geomspace(0.05, 2.0, 9)
    )
    _, f, b, e, x = search(
        np.geomspace(f / 1.6, f * 1.6, 13),
        np.geomspace(b / 1.6, b * 1.6, 13),
        np.geomspace(e / 1.6, e * 1.6, 7),
    )
    profile = DeviceProfile(
        name,
        peak_flops=f,
        bandwidth=b,
        memory_bytes=memory_bytes,
        link_bandwidth=1e12,
        host_bandwidth=1e12,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        attention_efficiency=e,
        overhead_s=float(x[0]),
        per_row_s=float(x[1]),
        per_token_s=float(x[2]),
    )
    cost = CostModel(profile, model, 1, block_size)
    pred = np.array([cost.step_time(s) for s in shapes])
    return profile, float(np.median(np.abs(pred / y - 1)))
