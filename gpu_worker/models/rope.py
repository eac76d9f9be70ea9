"""Rotary position embedding in the half-rotation ("neox") layout HF Llama uses.

A head vector `x = [x1 | x2]` (halves of `head_dim / 2`) at position `p` becomes
`[x1 * cos - x2 * sin | x2 * cos + x1 * sin]` with angles `p * inv_freq`.

Inverse frequencies, angles, cos and sin are computed in float32 with the same operations as
transformers (`modeling_rope_utils`) and only then cast to the model dtype: the table is then
bit-identical to the one a transformers model uses, whatever the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def inv_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Float32 inverse frequencies `[head_dim // 2]` for plain, `linear` or `llama3` RoPE."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_scaling(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """`[num_positions, head_dim]` table: cos in the first half of each row, sin in the second.

    One row per position, so a step gathers both with a single index op.
    """
    positions = torch.arange(num_positions, dtype=torch.int64).to(torch.float32)
    angles = positions[:, None] * inv_freq.to(torch.float32)[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by `cos`, `sin` `[T, 1, head_dim // 2]`; new tensor."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
