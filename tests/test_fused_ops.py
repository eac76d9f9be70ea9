"""The fused elementwise ops (gpu_worker/models/csrc/fused_ops_cpu.c) against float64
references: each computes in float32 and (in bf16) rounds once, so every bf16 output lies
within one bf16 rounding of the exact value and every float32 one within a few float32 ulps;
and against torch's ops in the same dtype, the path they replace."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models import fused_ops
from gpu_worker.models.fused_ops import FusedCpuOps, TorchOps
from gpu_worker.models.rope import apply_rotary, cos_sin_table, inv_frequencies
from pagedserve import envs

lib = fused_ops.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler here")
BF16 = torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "f32"])


def _ops(dtype: torch.dtype = BF16) -> FusedCpuOps:
    assert lib is not None
    return FusedCpuOps(lib, dtype)


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    """bf16: |got - exact| <= one bf16 ulp of `scale` (float32 arithmetic adds far less than
    that); float32: within 8 float32 ulps of it (a handful of float32 operations)."""
    ulp = 2.0**-7 if got.dtype == BF16 else 8 * 2.0**-23
    bound = scale.abs().clamp_min(1e-30) * ulp
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error {float((err / bound).max()):.2f} ulp"


@DTYPES
@pytest.mark.parametrize("rows", [1, 3, 64, 200])  # 200 x 576 crosses the threads' threshold
@pytest.mark.parametrize("hidden", [576, 72])  # 72: a tail after the 16-wide vectors
def test_add_rms_norm(rows: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows + hidden)
    h = (torch.randn(rows, hidden) * 3).to(dtype)
    delta = torch.randn(rows, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    eps = 1e-5

    summed = h + delta  # torch's add: the exact sum, rounded once
    h_out, x = _ops(dtype).add_rms_norm(h.clone(), delta, weight, eps)
    assert x.dtype == dtype and torch.equal(h_out, summed)
    s = summed.double()
    exact = s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight.double()
    _within_one_rounding(x, exact, exact)

    h_alone, x_alone = _ops(dtype).add_rms_norm(summed.clone(), None, weight, eps)
    assert torch.equal(h_alone, summed) and torch.equal(x_alone, x)
    torch.testing.assert_close(x, TorchOps().add_rms_norm(h, delta, weight, eps)[1])


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_mul(rows: int, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, -1e-3])  # zero, flushed, saturated, tiny
    got = _ops(dtype).silu_mul(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    exact = g * torch.sigmoid(g) * u
    # float32: exp's own error is a few ulps of silu(g), then scaled by up.
    _within_one_rounding(got, exact, exact if dtype == BF16 else (g * u).abs() + 1e-30)
    torch.testing.assert_close(got, TorchOps().silu_mul(gate_up), rtol=0.02, atol=1e-2)


@DTYPES
def test_nan_stays_nan(dtype: torch.dtype) -> None:
    gate_up = torch.randn(2, 64).to(dtype)
    gate_up[1, 3] = float("nan")
    out = _ops(dtype).silu_mul(gate_up)
    assert bool(out[1, 3].isnan()) and not bool(out[0].isnan().any())


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_rope_in_place_on_a_strided_view(head_dim: int, dtype: torch.dtype) -> None:
    """q|k heads of a fused qkv row are rotated in place; v's heads are not touched."""
    torch.manual_seed(head_dim)
    tokens, heads, kv = 9, 6, 2
    table = cos_sin_table(inv_frequencies(head_dim, 10000.0), 512, dtype)
    positions = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 64])
    qkv = torch.randn(tokens, heads + 2 * kv, head_dim).to(dtype)
    before = qkv.clone()
    qk = qkv[:, : heads + kv]
    ops = _ops(dtype)
    assert ops.rotate(qk, ops.rope_for(positions, table)) is qk
    assert torch.equal(qkv[:, heads + kv :], before[:, heads + kv :])
    half = head_dim // 2
    cs = table[positions].unsqueeze(1).double()
    x = before[:, : heads + kv].double()
    exact = apply_rotary(x, cs[..., :half], cs[..., half:])
    # float32: two products and a sum, each within an ulp of the inputs' magnitude.
    scale = exact if dtype == BF16 else x.abs() + x.roll(half, -1).abs()
    _within_one_rounding(qkv[:, : heads + kv], exact, scale)
    if dtype == torch.float32:  # torch's bf16 rope rounds after every op: not comparable
        torch_ops = TorchOps()
        theirs = torch_ops.rotate(before[:, : heads + kv], torch_ops.rope_for(positions, table))
        torch.testing.assert_close(qkv[:, : heads + kv], theirs)


def test_rope_refuses_positions_outside_the_table() -> None:
    table = cos_sin_table(inv_frequencies(64, 10000.0), 16, BF16)
    with pytest.raises(IndexError, match=r"\[0, 16\)"):
        _ops().rope_for(torch.tensor([3, 16]), table)


def test_chosen_for_bf16_and_float32_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert fused_ops.ops_for(BF16, cpu).name == "fused-bf16"
    assert fused_ops.ops_for(torch.float32, cpu).name == "fused-f32"
    assert type(fused_ops.ops_for(torch.float64, cpu)) is TorchOps  # the oracle's dtype
    monkeypatch.setenv("PAGEDSERVE_CPU_FUSED_OPS", "0")
    envs.reload()
    assert type(fused_ops.ops_for(BF16, cpu)) is TorchOps


@pytest.mark.parametrize(
    "rows,vocab,k", [(1, 49152, 32), (5, 1000, 32), (3, 37, 5), (64, 4099, 32)]
)
def test_widen_top_equals_torch(rows: int, vocab: int, k: int) -> None:
    """bf16 logits -> float32 and each row's k largest ids (ties at the k-th value may go
    either way); vocab sizes with and without a vector tail."""
    torch.manual_seed(vocab)
    logits = (torch.randn(rows, vocab) * 8).to(BF16)
    wide, top = _ops().widen_top(logits, k)
    assert wide.dtype == torch.float32 and torch.equal(wide, logits.float())
    kth = logits.float().topk(k, dim=1).values[:, -1:]
    picked = logits.float().gather(1, top)
    # Every pick is at least the k-th largest, and the picks are k distinct ids of the row.
    assert bool((picked >= kth).all())
    assert all(len(set(row.tolist())) == k for row in top)
    assert bool((logits.float() > kth).sum(1).le(k).all())


def test_widen_top_keeps_nan_out_of_the_top() -> None:
    logits = torch.arange(100, dtype=torch.float32).to(BF16).reshape(1, 100)
    logits[0, 50] = float("nan")
    wide, top = _ops().widen_top(logits, 4)
    assert sorted(top[0].tolist()) == [96, 97, 98, 99] and bool(wide[0, 50].isnan())


@pytest.mark.parametrize(
    "rows,vocab,hidden,k", [(1, 300, 576, 32), (64, 4099, 72, 32), (3, 40, 8, 5)]
)
def test_refine_top_writes_float32_dot_products_at_the_top_ids(
    rows: int, vocab: int, hidden: int, k: int
) -> None:
    """At each row's top ids the logits become float32 sums of the exact products of the bf16
    hidden state and head row (within float32 rounding of the float64 dot product, and of
    torch's gather-and-bmm reference); every other logit is left alone. Hidden sizes with and
    without a vector tail, and one below a vector."""
    torch.manual_seed(hidden)
    x = torch.randn(rows, hidden).to(BF16)
    head = torch.randn(vocab, hidden).to(BF16)
    logits = torch.randn(rows, vocab)
    top = torch.stack([torch.randperm(vocab)[:k] for _ in range(rows)])
    got, want = logits.clone(), logits.clone()
    _ops().refine_top(got, top, x, head)
    TorchOps().refine_top(want, top, x, head)
    exact = x.double() @ head.double().T  # [rows, vocab]
    mask = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, top, True)
    assert torch.equal(got[~mask], logits[~mask])
    scale = (x.double().abs() @ head.double().abs().T)[mask]  # sum of |products|: the bound
    assert bool(((got[mask].double() - exact[mask]).abs() <= scale * hidden * 2.0**-24).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
