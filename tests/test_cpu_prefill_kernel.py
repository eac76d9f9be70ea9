"""The CPU kernel for prompt chunks' causal attention (gpu_worker/attention/csrc/
prefill_attention_cpu.c), fresh and after context in a paged cache, against a float64
reference, and the torch backend with it against its SDPA path."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import cpu_kernels
from gpu_worker.attention import cpu_prefill
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from pagedserve import envs
from tests.test_cpu_fast_paths import Step, assert_paths_agree, backend_outputs

needs_kernel = pytest.mark.skipif(cpu_prefill.load() is None, reason="no C compiler here")

# Segment lengths around the kernel's row blocks (4), key tiles (16) and work items (32).
LENS = [1, 2, 5, 16, 17, 33, 40, 100]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64, written out: [T, H, D] queries, the last T of the [N, KV, D]
    keys and values (N - T of context before them)."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))  # [heads, T or N, D]
    kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    t, n = q.shape[0], k.shape[0]
    scores.masked_fill_(torch.ones(t, n, dtype=torch.bool).triu(n - t + 1), float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


def _step(
    lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segment starts with two rows of other work before each, q/k/v as views of one fused
    projection (token stride past each tensor's heads), and an output filled with 7s."""
    starts, at = [], 0
    for n in lens:
        starts.append(at + 2)
        at += n + 2
    qkv = torch.randn(at, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    q = qkv[:, :num_heads]
    k = qkv[:, num_heads : num_heads + num_kv_heads]
    v = qkv[:, num_heads + num_kv_heads :]
    return starts, q, k, v, torch.full((at, num_heads, head_dim), 7.0, dtype=dtype)


SHAPES = [(8, 4, 32), (12, 4, 64), (4, 4, 128), (6, 2, 48), (3, 1, 16), (9, 3, 80)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Segments of every length among rows the kernel must leave alone, q/k/v as views of one
    fused projection (token stride past each tensor's heads)."""
    torch.manual_seed(head_dim + num_heads)
    starts, q, k, v, out = _step(LENS, num_heads, num_kv_heads, head_dim, dtype)
    total = q.shape[0]
    scale = head_dim**-0.5
    cpu_prefill.prefill_attention(
        out,
        q,
        k,
        v,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(LENS, dtype=torch.int32),
        scale,
    )
    written = torch.zeros(total, dtype=torch.bool)
    # bf16: the inputs are exact in the float64 reference; only the output's rounding differs.
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    for s, n in zip(starts, LENS, strict=True):
        rows = slice(s, s + n)
        want = _reference(q[rows], k[rows], v[rows], scale)
        torch.testing.assert_close(out[rows].double(), want, rtol=tol, atol=1e-5)
        written[rows] = True
    assert bool((out[~written] == 7.0).all())


# (context, new rows) per segment: context within a block, on a block's edge, across several
# blocks, and none (a fresh prompt in the same call).
CHUNKS = [(5, 3), (16, 17), (37, 1), (0, 9), (70, 40), (1, 33)]


@needs_kernel
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 32), (9, 3, 64)])
def test_chunks_after_paged_context_match_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """Each segment's context is read from a paged cache through a shuffled block table in the
    cache's dtype; its own rows come from the step's k and v."""
    torch.manual_seed(num_heads)
    bs, width = 16, 8
    num_blocks = len(CHUNKS) * width + 3
    k_cache = torch.randn(num_blocks, bs, num_kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, num_kv_heads, head_dim).to(cache_dtype)
    tables = torch.randperm(num_blocks)[: len(CHUNKS) * width].view(len(CHUNKS), width)
    tables = tables.to(torch.int32).contiguous()
    starts, q, k, v, out = _step([n for _, n in CHUNKS], num_heads, num_kv_heads, head_dim, dtype)
    at = q.shape[0]
    scale = head_dim**-0.5
    context = cpu_prefill.PagedContext(
        torch.tensor([c for c, _ in CHUNKS], dtype=torch.int32), k_cache, v_cache, tables
    )
    cpu_prefill.prefill_attention(
        out,
        q,
        k,
        v,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([n for _, n in CHUNKS], dtype=torch.int32),
        scale,
        context,
    )
    written = torch.zeros(at, dtype=torch.bool)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    for s, (start, (c, n)) in enumerate(zip(starts, CHUNKS, strict=True)):
        slots = (tables[s].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:c]
        flat = (-1, num_kv_heads, head_dim)
        rows = slice(start, start + n)
        keys = torch.cat([k_cache.view(flat)[slots].to(dtype), k[rows]])
        values = torch.cat([v_cache.view(flat)[slots].to(dtype), v[rows]])
        want = _reference(q[rows], keys, values, scale)
        torch.testing.assert_close(out[rows].double(), want, rtol=tol, atol=1e-5)
        written[rows] = True
    assert bool((out[~written] == 7.0).all())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_with_kernel_equals_its_sdpa_path(dtype: torch.dtype) -> None:
    """Steps mixing fresh prompts with chunks after context and decodes, through both paths."""
    steps = [
        [([3, 9, 4], 0, 40), ([7], 0, 5), ([10], 0, 2)],
        [([3, 9, 4], 40, 1), ([7, 1], 5, 20), ([2, 5], 0, 17), ([6, 8], 0, 23)],
    ]

    outs = {}
    for on in (True, False):

        def configure(backend: TorchAttentionBackend, on: bool = on) -> None:
            backend.use_prefill_kernel = on  # whatever this CPU would prefer

        def check(backend: TorchAttentionBackend, seqs: Step, on: bool = on) -> None:
            assert (backend._segments is not None) == on
            # With it, chunks after context go to the kernel too: nothing is gathered.
            chunks = any(c > 0 and n > 1 for _, c, n in seqs)
            assert len(backend._groups) == (0 if on else int(chunks))

        outs[on] = backend_outputs(steps, dtype, configure, check)
    assert_paths_agree(outs[True], outs[False], dtype)

    def one_per_call(backend: TorchAttentionBackend) -> None:
        backend.use_prefill_kernel = True
        backend.MAX_WIDENED_FLOATS = 1  # every segment a call of its own

    def calls(backend: TorchAttentionBackend, seqs: Step) -> None:
        assert backend._segments is not None
        assert len(backend._segments.calls) == sum(n > 1 for *_, n in seqs)

    split = backend_outputs(steps, dtype, one_per_call, calls)
    for x, y in zip(split, outs[True], strict=True):
        assert torch.equal(x, y)  # the same arithmetic per row, whatever the calls


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 256])
def test_bf16_scores_are_the_float32_paths(head_dim: int) -> None:
    """With a power-of-two scale, bf16 q, k and v give the float32 kernel's output on their
    widened values, rounded once: the bf16 path (keys in bf16 pairs where the CPU has
    vdpbf16ps) sums the same products in the same order."""
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads = 6, 2
    starts, q, k, v, out = _step(LENS, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    lens_t = torch.tensor(LENS, dtype=torch.int32)
    scale = head_dim**-0.5
    cpu_prefill.prefill_attention(out, q, k, v, starts_t, lens_t, scale)
    wide = torch.zeros(out.shape, dtype=torch.float32)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    cpu_prefill.prefill_attention(wide, q32, k32, v32, starts_t, lens_t, scale)
    for s, n in zip(starts, LENS, strict=True):
        assert torch.equal(out[s : s + n], wide[s : s + n].to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize(("length", "context"), [(0, None), (4, 33)])
def test_a_bad_segment_is_refused(length: int, context: int | None) -> None:
    """An empty segment, and one whose context runs past its block table."""
    x = torch.zeros(4, 2, 32)
    cache = torch.zeros(3, 16, 2, 32)
    paged = None
    if context is not None:
        ctx = torch.tensor([context], dtype=torch.int32)
        paged = cpu_prefill.PagedContext(ctx, cache, cache, torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="code 3"):
        cpu_prefill.prefill_attention(
            torch.zeros_like(x),
            x,
            x,
            x,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([length], dtype=torch.int32),
            1.0,
            paged,
        )


def test_float64_keeps_sdpa() -> None:
    assert not cpu_prefill.supports(64, torch.float64)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL_KERNEL", "0")
    envs.reload()
    assert cpu_prefill.load() is None
    assert not cpu_prefill.preferred("avx2 avx512f fma")


def test_preferred_where_the_cpu_has_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_CPU_PREFILL_KERNEL", raising=False)
    envs.reload()
    assert cpu_prefill.preferred("avx2 avx512bw avx512f fma")
    assert not cpu_prefill.preferred("avx avx2 fma")  # SDPA is faster there
    monkeypatch.setenv("PAGEDSERVE_CPU_PREFILL_KERNEL", "1")
    envs.reload()
    assert cpu_prefill.preferred("avx avx2 fma")
