"""The CPU fast paths against the plain ones: the decode kernel
(gpu_worker/attention/csrc/paged_decode_cpu.c) against the slow torch reference and the torch
backend's SDPA path, and the oneDNN-prepacked linears against F.linear."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import cpu_isa, cpu_kernels
from gpu_worker.attention import BatchLayout, cpu_decode
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.kv_cache import CacheGeometry, KVCache
from pagedserve import envs
from tests.kernel_refs import ref_paged_attention

needs_kernel = pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler here")


@pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler here",
)
def test_kernel_builds_where_there_is_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel tests skip without the kernel: a source that stopped compiling must fail."""
    monkeypatch.delenv("PAGEDSERVE_CPU_DECODE_KERNEL", raising=False)
    envs.reload()
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_decode.load() is not None


@pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler here",
)
def test_kernel_cache_is_keyed_by_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache shared by machines (an image, an NFS home) never hands a `-march=native` build
    for one CPU to another: the CPU's feature flags are part of the library's name."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    envs.reload()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    here = cpu_kernels.library_path(cc, cpu_decode.SOURCE)
    assert cpu_isa.cpu_features()  # read from this machine
    monkeypatch.setattr(cpu_isa, "cpu_features", lambda: "fpu sse sse2")  # an older CPU
    there = cpu_kernels.library_path(cc, cpu_decode.SOURCE)
    assert here.parent == there.parent == tmp_path / "kernels"
    assert here != there
    # What was built here is not what the older CPU would load.
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.delenv("PAGEDSERVE_CPU_DECODE_KERNEL", raising=False)
    envs.reload()
    assert cpu_decode.load() is not None
    assert there.exists() and not here.exists()


def _decode_case(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> dict[str, Any]:
    """Random decode inputs: scattered blocks, lengths around block edges, and decode rows
    sitting among other (prefill) rows, out of order, in q rows shared with k's heads."""
    rng = random.Random(num_heads * 1000 + head_dim)
    torch.manual_seed(head_dim)
    lens = [1, block_size - 1, block_size, block_size + 1, 100, 3 * block_size + 5, 7]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(-(-n // block_size) for n in lens) + 1  # one padding column
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for s, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[s, j] = free.pop()
    num_tokens = len(lens) + 3
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim).to(dtype)
    return {
        "q": qk[:, :num_heads],
        "rows": torch.tensor(rng.sample(range(num_tokens), len(lens)), dtype=torch.long),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "max_len": max(lens),
        "scale": head_dim**-0.5,
    }


def _run_decode(case: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The kernel on `case` with q and the caches in `dtype`; rows it must not write hold 7."""
    q = case["q"]
    args = {**case, "q": q.to(dtype)}
    args["k_cache"], args["v_cache"] = case["k_cache"].to(dtype), case["v_cache"].to(dtype)
    out = torch.full(q.shape, 7.0, dtype=dtype)
    cpu_decode.paged_decode(out, **args)
    return out


SHAPES = [(8, 4, 32, 16), (12, 4, 64, 16), (4, 4, 128, 8), (6, 2, 48, 16), (3, 1, 16, 32)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES)
def test_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    c = _decode_case(num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = _run_decode(c, dtype)
    rows, lens = c["rows"], c["seq_lens"].tolist()
    want = ref_paged_attention(
        c["q"][rows],
        c["k_cache"],
        c["v_cache"],
        c["block_tables"],
        [1] * len(lens),
        lens,
        c["scale"],
    )
    # bf16: the inputs are exact in the float64 reference; only the output's rounding differs.
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out[rows].double(), want, rtol=tol, atol=1e-5)
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all())


def _layout(seqs: list[tuple[list[int], int, int]], block_size: int) -> BatchLayout:
    slots: list[int] = []
    starts = [0]
    for table, ctx, n in seqs:
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
        starts.append(starts[-1] + n)
    width = max(len(t) for t, _, _ in seqs)
    return BatchLayout(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for _, c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int32
        ),
        query_lens_host=[n for _, _, n in seqs],
        seq_lens_host=[c + n for _, c, n in seqs],
    )


Step = list[tuple[list[int], int, int]]  # per sequence: (block table, context, new tokens)


def backend_outputs(
    steps: list[Step],
    dtype: torch.dtype,
    configure: Callable[[TorchAttentionBackend], None],
    check: Callable[[TorchAttentionBackend, Step], None],
) -> list[torch.Tensor]:
    """Every layer's attention output over `steps` (2 layers, 8 query heads over 4 kv heads of
    32, blocks of 16, inputs from seed 0) through a torch backend `configure` has set up;
    `check` looks at the backend after each step has begun."""
    bs, heads = 16, 8
    torch.manual_seed(0)
    cache = KVCache(CacheGeometry(2, 4, 32, bs, dtype), 12, 0, "cpu")
    backend = TorchAttentionBackend(cache, heads, 32)
    configure(backend)
    got = []
    for seqs in steps:
        backend.begin_step(_layout(seqs, bs))
        check(backend, seqs)
        t = sum(n for *_, n in seqs)
        for layer in range(2):
            q, k, v = (torch.randn(t, n, 32).to(dtype) for n in (heads, 4, 4))
            got.append(backend.forward(layer, q, k, v))
    return got


def assert_paths_agree(a: list[torch.Tensor], b: list[torch.Tensor], dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: SDPA rounds its own steps
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype == dtype
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_with_kernel_equals_its_sdpa_path(dtype: torch.dtype) -> None:
    """Mixed steps (prefill chunks after context, decodes, all-decode) through both paths."""
    steps = [
        [([3, 9, 4], 0, 40), ([7], 0, 5)],
        [([3, 9, 4], 40, 1), ([7, 1], 5, 20), ([2, 5], 0, 17)],
        [([3, 9, 4], 41, 1), ([7, 1], 25, 1), ([2, 5], 17, 1)],
    ]

    outs = {}
    for on in (True, False):

        def configure(backend: TorchAttentionBackend, on: bool = on) -> None:
            assert backend.use_decode_kernel
            backend.use_decode_kernel = on

        def check(backend: TorchAttentionBackend, seqs: Step, on: bool = on) -> None:
            assert (backend._decodes is not None) == (on and any(n == 1 for *_, n in seqs))

        outs[on] = backend_outputs(steps, dtype, configure, check)
    assert_paths_agree(outs[True], outs[False], dtype)


@needs_kernel
def test_lengths_past_max_len_are_refused() -> None:
    kc = torch.zeros(2, 16, 1, 32)
    out, q = torch.zeros(1, 1, 32), torch.zeros(1, 1, 32)
    rows, tables = torch.zeros(1, dtype=torch.long), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="code 3"):
        cpu_decode.paged_decode(
            out, q, rows, kc, kc, tables, torch.tensor([20], dtype=torch.int32), 16, 1.0
        )


def test_other_dtypes_keep_the_sdpa_path() -> None:
    cache = KVCache(CacheGeometry(1, 2, 32, 16, torch.float64), 4, 0, "cpu")
    assert not TorchAttentionBackend(cache, 4, 32).use_decode_kernel


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_CPU_DECODE_KERNEL", "0")
    envs.reload()
    assert cpu_decode.load() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_prepacked_linears_match_plain(
    dtype: torch.dtype, make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_worker.checkpoint import load_model
    from gpu_worker.models.llama import DecoderLayer, prepack_supported

    model = load_model(make_checkpoint("qwen2", num_hidden_layers=2), dtype=dtype)
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    packed = prepack_supported(dtype, torch.device("cpu"))
    # bfloat16 is packed everywhere: natively, or widened to float32 where the CPU has no bf16
    # products.
    assert packed == (dtype != torch.float64 and torch.backends.mkldnn.is_available())
    assert (model.lm_head_packed is not None) == packed == (layer.qkv_packed is not None)

    def logits() -> torch.Tensor:
        ids = torch.tensor([5, 9, 300, 17, 42])
        seen: list[torch.Tensor] = []

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                enable_gqa=True,
            ).transpose(0, 1)  # fmt: skip

        with torch.inference_mode():
            out = model.compute_logits(model(ids, torch.arange(5), attn))
        seen.append(out)
        return out

    fast = logits()
    monkeypatch.setenv("PAGEDSERVE_ONEDNN_LINEAR", "0")
    envs.reload()
    model.prepack()
    assert model.lm_head_packed is None and layer.qkv_packed is None
    plain = logits()
    if dtype == torch.bfloat16:  # bf16 rounding of every activation, compounded
        torch.testing.assert_close(fast, plain, rtol=0.05, atol=0.25)
    else:
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-3)
        assert torch.equal(fast.argmax(-1), plain.argmax(-1))


def test_widened_bf16_projections(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model whose projections multiply in float32 (the path of CPUs without bf16
    products, forced here on any CPU): float32 copies of the weights, no row padding, bf16
    outputs, and float32 logits that are the float32 product of the bf16 hidden state and LM
    head, every one of them (no refinement of a rounded head needed)."""
    from gpu_worker.checkpoint import load_model
    from gpu_worker.models.llama import DecoderLayer

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setenv("PAGEDSERVE_BF16_WIDEN", "1")
    envs.reload()
    model = load_model(make_checkpoint("qwen2", num_hidden_layers=2), dtype=torch.bfloat16)
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert layer.qkv_packed is not None and layer.qkv_packed.dtype == torch.float32
    assert model.projection_path() == "onednn-float32-widened"
    assert model.row_padding(5) == 0
    assert model.warm_up(3) == 5 * 3  # every row count, as float32 does

    x = torch.randn(7, layer.qkv_weight.shape[1]).to(torch.bfloat16)
    from gpu_worker.models.llama import _linear

    out = _linear(x, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed)
    assert out.dtype == torch.bfloat16
    bias = layer.qkv_bias
    assert bias is not None  # qwen2's q/k/v biases
    exact = x.double() @ layer.qkv_weight.double().T + bias.double()
    # One rounding to bf16 of a float32 sum of exact products.
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-3)

    hidden = torch.randn(3, x.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits.double(), hidden.double() @ model.lm_head.double().T, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize(("isa", "align"), [("amx_bf16", 16), ("avx512_bf16", 1)])
def test_native_bf16_rows_padded_to_amx_tiles_only(
    isa: str, align: int, make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Native bf16 products pad their rows to AMX's 16-row tiles where the CPU has AMX, and
    not where it has AVX512-BF16 alone; `warm_up` builds exactly the row counts that then
    reach oneDNN (each multiple of the alignment up to 128, and the 512-row piece), and a
    padded product returns the rows it was given, equal to the unpadded one's."""
    from gpu_worker.checkpoint import load_model
    from gpu_worker.models import llama

    if llama.pack_dtype(torch.bfloat16, torch.device("cpu")) != torch.bfloat16:
        pytest.skip("this CPU has no native bf16 products")
    monkeypatch.delenv("PAGEDSERVE_BF16_ROW_ALIGN", raising=False)
    envs.reload()
    monkeypatch.setattr(cpu_isa, "bf16_isa", lambda features=None: isa)
    llama.bf16_row_align.cache_clear()
    try:
        assert llama.bf16_row_align() == align
        model = load_model(make_checkpoint("qwen2", num_hidden_layers=2), dtype=torch.bfloat16)
        assert [model.row_padding(n) for n in (1, 16, 17, 40)] == (
            [15, 0, 15, 8] if align == 16 else [0, 0, 0, 0]
        )
        per_projection = 8 + 1 if align == 16 else 128 + 1
        assert model.warm_up(200) == 5 * per_projection
        layer = model.layers[0]
        assert isinstance(layer, llama.DecoderLayer)
        x = torch.randn(21, layer.qkv_weight.shape[1]).to(torch.bfloat16)
        out = llama._linear(x, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed)
        assert out.shape == (21, layer.qkv_weight.shape[0])
        monkeypatch.setenv("PAGEDSERVE_BF16_ROW_ALIGN", "16" if align == 1 else "1")
        envs.reload()
        llama.bf16_row_align.cache_clear()
        other = llama._linear(x, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed)
        torch.testing.assert_close(out, other, rtol=2**-7, atol=1e-2)
    finally:
        llama.bf16_row_align.cache_clear()
