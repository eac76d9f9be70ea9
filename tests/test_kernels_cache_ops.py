"""reshape_and_cache and copy_blocks against their references, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.copy_blocks import copy_blocks
from kernels.reshape_and_cache import reshape_and_cache
from tests.kernel_refs import DEVICE, huge_kv_pool, ref_copy_blocks, ref_reshape_and_cache


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype"),
    [
        (8, 1, 64, torch.float32),
        (16, 8, 128, torch.bfloat16),
        (32, 2, 64, torch.float16),
        (16, 3, 80, torch.float32),  # heads and head_dim both padded in the kernel
    ],
)
def test_reshape_and_cache_matches_reference(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 9, 45
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # The worker's layout: K and V caches are views into one pool.
    pool = torch.randn((2, *shape), generator=gen).to(dtype).to(DEVICE)
    k_cache, v_cache = pool[0], pool[1]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 7, 44]] = -1  # skipped
    slots = slots.to(DEVICE)
    # Slices of a fused projection: strided along tokens.
    kv = torch.randn((num_tokens, 2, num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    key, value = kv[:, 0], kv[:, 1]

    reshape_and_cache(key, value, k_cache, v_cache, slots)
    ref_reshape_and_cache(key, value, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_reshape_and_cache_casts_to_the_cache_dtype() -> None:
    k_cache = torch.zeros((4, 16, 2, 64), dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn((5, 2, 64), device=DEVICE)
    slots = torch.tensor([0, 17, 18, 63, -1], device=DEVICE)
    reshape_and_cache(key, key * 2, k_cache, v_cache, slots)
    want = torch.zeros_like(k_cache)
    ref_reshape_and_cache(key.half(), key.half(), want, want.clone(), slots)
    torch.testing.assert_close(k_cache, want, atol=1e-3, rtol=1e-3)


def test_reshape_and_cache_slot_beyond_32_bits() -> None:
    k_cache, v_cache, big = huge_kv_pool(16, 1, 64, torch.float16)
    k_cache[2], v_cache[2] = 0, 0
    key = torch.randn((3, 1, 64), device=DEVICE).half()
    slots = torch.tensor([(big + 2) * 16 + 5, (big + 2) * 16 + 15, -1], device=DEVICE)
    reshape_and_cache(key, -key, k_cache, v_cache, slots)
    assert torch.equal(k_cache[big + 2, 5], key[0]) and torch.equal(k_cache[big + 2, 15], key[1])
    assert torch.equal(v_cache[big + 2, 5], -key[0])
    assert not bool(k_cache[2].any())  # a wrapped offset would have written here


def test_reshape_and_cache_refuses_bad_input() -> None:
    cache = torch.zeros((4, 16, 2, 64), device=DEVICE)
    key = torch.zeros((3, 2, 64), device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, cache, cache, slots.int())
    with pytest.raises(ValueError, match="3 slots for 2 tokens"):
        reshape_and_cache(key[:2], key[:2], cache, cache, slots)
    with pytest.raises(ValueError, match=r"\[num_tokens, 2, 64\]"):
        reshape_and_cache(key[:, :1], key[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="block_size"):
        bad = torch.zeros((4, 6, 2, 64), device=DEVICE)
        reshape_and_cache(key, key, bad, bad, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference(dtype: torch.dtype) -> None:
    # The worker's pool [layers, 2, num_blocks, block_size, kv_heads, head_dim], flattened.
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((3, 2, 10, 16, 2, 64), generator=gen).to(dtype).to(DEVICE)
    caches = kv.flatten(0, 1)
    pairs = [(1, 4), (1, 7), (9, 0), (3, 2)]
    want = caches.clone()
    ref_copy_blocks(want, pairs)
    copy_blocks(caches, torch.tensor(pairs, dtype=torch.int64, device=DEVICE))
    assert torch.equal(caches, want)
    assert torch.equal(kv.flatten(0, 1), want)  # in place, through the view


def test_copy_blocks_beyond_32_bits() -> None:
    k_cache, v_cache, big = huge_kv_pool(16, 1, 64, torch.float16)
    # [2 (K, V), num_blocks, ...] over the interleaved pool: V starts one block-size later.
    caches = k_cache.as_strided((2, *k_cache.shape), (k_cache[0].numel(), *k_cache.stride()))
    assert caches[1].data_ptr() == v_cache.data_ptr()
    src = torch.randn((2, 16, 1, 64), device=DEVICE).half()
    caches[:, big + 1] = src
    caches[:, 1] = 0
    copy_blocks(caches, torch.tensor([[big + 1, big + 3], [big + 1, 0]], device=DEVICE))
    assert torch.equal(caches[:, big + 3], src) and torch.equal(caches[:, 0], src)
    assert torch.equal(v_cache[big + 3], src[1])
    assert not bool(caches[:, 3].any())  # a wrapped offset would have written here


def test_copy_blocks_refuses_bad_input() -> None:
    caches = torch.zeros((2, 4, 16, 2, 64), device=DEVICE)
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks(caches, torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(caches.transpose(3, 4), torch.tensor([[0, 1]], device=DEVICE))
