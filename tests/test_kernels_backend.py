"""The triton attention backend against the torch one, on the worker's own KV pool and batch
layout, under the Triton interpreter: mixed prefill + decode steps, split-K decode, and the
errors the registry gives outside the envelope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpu_worker.attention import AttentionBackend, BatchLayout, create_backend
from gpu_worker.attention import triton_backend as triton_module
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.kv_cache import CacheGeometry, KVCache
from kernels import envelope
from tests.kernel_refs import DEVICE

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 64, 16


def torch_backend(cache: KVCache, num_heads: int) -> AttentionBackend:
    return TorchAttentionBackend(cache, num_heads, HEAD_DIM)


def triton_backend(cache: KVCache, num_heads: int) -> AttentionBackend:
    return TritonAttentionBackend(cache, num_heads, HEAD_DIM)


def make_cache(dtype: torch.dtype = torch.float32, device: str = DEVICE) -> KVCache:
    geometry = CacheGeometry(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)
    return KVCache(geometry, 96, 0, device)


def layout(seqs: list[tuple[list[int], int, int]]) -> BatchLayout:
    """seqs: (block table, cached tokens, new tokens), laid out as the model runner does."""
    slots: list[int] = []
    starts = [0]
    for table, ctx, n in seqs:
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, ctx + n)]
        starts.append(starts[-1] + n)
    width = max(len(t) for t, _, _ in seqs)
    return BatchLayout(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c + n for _, c, n in seqs], dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int32, device=DEVICE
        ),
        query_lens_host=[n for _, _, n in seqs],
        seq_lens_host=[c + n for _, c, n in seqs],
    )


def run_steps(
    make_backend: Callable[[KVCache, int], AttentionBackend],
    steps: list[BatchLayout],
    num_heads: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], KVCache]:
    cache = make_cache(dtype)
    backend = make_backend(cache, num_heads)
    gen = torch.Generator().manual_seed(0)
    outs = []
    for lay in steps:
        backend.begin_step(lay)
        t = len(lay.slot_mapping)
        for layer in range(NUM_LAYERS):
            q = torch.randn((t, num_heads, HEAD_DIM), generator=gen).to(DEVICE, dtype)
            # k, v as slices of one fused tensor, like a qkv projection's output.
            kv = torch.randn((t, 2 * NUM_KV_HEADS, HEAD_DIM), generator=gen).to(DEVICE, dtype)
            k, v = kv[:, :NUM_KV_HEADS], kv[:, NUM_KV_HEADS:]
            outs.append(backend.forward(layer, q, k, v))
    return outs, cache


@pytest.mark.parametrize(
    ("num_heads", "dtype"),
    [(2, torch.float32), (8, torch.float32), (8, torch.bfloat16)],  # MHA and GQA 4
)
def test_matches_torch_backend_over_mixed_steps(num_heads: int, dtype: torch.dtype) -> None:
    a, b, c, d = list(range(0, 5)), list(range(10, 16)), list(range(20, 23)), [40, 41, 42]
    steps = [
        layout([(a, 0, 40), (b, 0, 16), (c, 0, 1)]),  # prefills, one a single token
        layout([(a, 40, 1), (b, 16, 37), (c, 1, 1), (d, 0, 33)]),  # decodes + chunk + new
        layout([(a, 41, 1), (b, 53, 1), (c, 2, 1)]),  # decodes only
    ]
    want, want_cache = run_steps(torch_backend, steps, num_heads, dtype)
    got, got_cache = run_steps(triton_backend, steps, num_heads, dtype)
    assert torch.equal(got_cache.kv, want_cache.kv)
    # bf16: each side rounds its softmax weights and output to bf16 (test_kernels_decode).
    atol, rtol = (2e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def test_split_k_decode_in_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device with 64 SMs, two sequences and a 1100-token context: the heuristic splits."""
    steps = [layout([(list(range(70)), 1100, 1), ([80], 3, 1)])]
    want, _ = run_steps(torch_backend, steps, 4)
    calls: list[int] = []
    real = triton_module.paged_decode_attention_splitk

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_module, "paged_decode_attention_splitk", spy)

    def make(cache: KVCache, num_heads: int) -> AttentionBackend:
        backend = TritonAttentionBackend(cache, num_heads, HEAD_DIM)
        backend.num_sms = 64
        return backend

    got, _ = run_steps(make, steps, 4)
    assert calls, "split-K was not chosen"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


def test_registry_picks_triton_on_request() -> None:
    backend = create_backend("triton", make_cache(), 4, HEAD_DIM, DEVICE)
    assert backend.name == "triton"
    cpu = make_cache(device="cpu")
    assert create_backend(None, cpu, 4, HEAD_DIM, "cpu").name == "torch"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(envelope, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*--attention-backend torch"):
        create_backend("triton", make_cache(device="cpu"), 4, HEAD_DIM, "cpu")


def test_model_outside_the_envelope_fails_at_start() -> None:
    with pytest.raises(ValueError, match="float64"):
        create_backend("triton", make_cache(torch.float64, "cpu"), 4, HEAD_DIM, "cpu")
    geometry = CacheGeometry(1, 2, 24, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="head_dim 24"):
        create_backend("triton", KVCache(geometry, 4, 0, "cpu"), 4, 24, "cpu")
