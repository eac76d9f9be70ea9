"""The fused bf16 elementwise ops (gpu_worker/models/csrc/fused_ops_cpu.c) against float64
references: each computes in float32 and rounds once, so every output lies within one bf16
rounding of the exact value; and against torch's bf16 ops, the path they replace."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models import fused_ops
from gpu_worker.models.fused_ops import FusedBf16Ops, TorchOps
from gpu_worker.models.rope import apply_rotary, cos_sin_table, inv_frequencies

lib = fused_ops.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler here")
BF16 = torch.bfloat16


def _ops() -> FusedBf16Ops:
    assert lib is not None
    return FusedBf16Ops(lib)


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """|got - exact| <= one bf16 ulp of exact (float32 arithmetic adds far less than that)."""
    assert got.dtype == BF16
    ulp = exact.abs().clamp_min(1e-30) * 2.0**-7
    err = (got.double() - exact).abs()
    assert bool((err <= ulp).all()), f"worst error {float((err / ulp).max()):.2f} ulp"


@pytest.mark.parametrize("rows", [1, 3, 64, 200])  # 200 x 576 crosses the threads' threshold
@pytest.mark.parametrize("hidden", [576, 72])  # 72: a tail after the 16-wide vectors
def test_add_rms_norm(rows: int, hidden: int) -> None:
    torch.manual_seed(rows + hidden)
    h = (torch.randn(rows, hidden) * 3).to(BF16)
    delta = torch.randn(rows, hidden).to(BF16)
    weight = (1 + 0.1 * torch.randn(hidden)).to(BF16)
    eps = 1e-5

    summed = (h.float() + delta.float()).to(BF16)  # torch's bf16 add: exact sum, rounded
    h_out, x = _ops().add_rms_norm(h.clone(), delta, weight, eps)
    assert torch.equal(h_out, summed)
    s = summed.double()
    exact = s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight.double()
    _within_one_rounding(x, exact)

    h_alone, x_alone = _ops().add_rms_norm(summed.clone(), None, weight, eps)
    assert torch.equal(h_alone, summed) and torch.equal(x_alone, x)
    torch.testing.assert_close(x, TorchOps().add_rms_norm(h, delta, weight, eps)[1])


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_mul(rows: int, inter: int) -> None:
    torch.manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(BF16)
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, -1e-3])  # zero, flushed, saturated, tiny
    got = _ops().silu_mul(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    exact = g * torch.sigmoid(g) * u
    _within_one_rounding(got, exact)
    torch.testing.assert_close(got, TorchOps().silu_mul(gate_up), rtol=0.02, atol=1e-2)


def test_nan_stays_nan() -> None:
    gate_up = torch.randn(2, 64).to(BF16)
    gate_up[1, 3] = float("nan")
    out = _ops().silu_mul(gate_up)
    assert bool(out[1, 3].isnan()) and not bool(out[0].isnan().any())


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_rope_in_place_on_a_strided_view(head_dim: int) -> None:
    """q|k heads of a fused qkv row are rotated in place; v's heads are not touched."""
    torch.manual_seed(head_dim)
    tokens, heads, kv = 9, 6, 2
    table = cos_sin_table(inv_frequencies(head_dim, 10000.0), 512, BF16)
    positions = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 64])
    qkv = torch.randn(tokens, heads + 2 * kv, head_dim).to(BF16)
    before = qkv.clone()
    qk = qkv[:, : heads + kv]
    ops = _ops()
    assert ops.rotate(qk, ops.rope_for(positions, table)) is qk
    assert torch.equal(qkv[:, heads + kv :], before[:, heads + kv :])
    half = head_dim // 2
    cs = table[positions].unsqueeze(1).double()
    exact = apply_rotary(before[:, : heads + kv].double(), cs[..., :half], cs[..., half:])
    _within_one_rounding(qkv[:, : heads + kv], exact)


def test_rope_refuses_positions_outside_the_table() -> None:
    table = cos_sin_table(inv_frequencies(64, 10000.0), 16, BF16)
    with pytest.raises(IndexError, match=r"\[0, 16\)"):
        _ops().rope_for(torch.tensor([3, 16]), table)


def test_chosen_for_bf16_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert isinstance(fused_ops.ops_for(BF16, cpu), FusedBf16Ops)
    for dtype in (torch.float32, torch.float64):
        assert type(fused_ops.ops_for(dtype, cpu)) is TorchOps
    monkeypatch.setenv("PAGEDSERVE_CPU_FUSED_OPS", "0")
    assert type(fused_ops.ops_for(BF16, cpu)) is TorchOps
