"""reshape_and_cache: scatter a step's new K and V rows into their paged-cache slots.

Token t's key/value [num_kv_heads, head_dim] goes to slot_mapping[t], a flat slot index
(block_id * block_size + offset in block); a negative slot means "do not write" (a padded
token, or one whose K/V another path owns). One program moves BLOCK_T tokens, all heads.

Layout:
    key, value    [num_tokens, num_kv_heads, head_dim]             (any dtype in the envelope;
                                                                    cast to the cache's)
    k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping  [num_tokens] int64

Slots are int64 and widen the block offset: block * stride_block overflows 32 bits in pools
past 2^31 elements. Limits: kernels.envelope (block sizes, head dims, dtypes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import envelope


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    row_mask = slot >= 0  # also false past num_tokens
    mask = row_mask[:, None, None] & (h < NUM_KV_HEADS)[None, :, None]
    mask = mask & (d < HEAD_DIM)[None, None, :]
    t64 = t.to(tl.int64)[:, None, None]
    hd = h[None, :, None]
    dd = d[None, None, :]

    k = tl.load(key_ptr + t64 * stride_kt + hd * stride_kh + dd, mask=mask)
    k_off = (block * stride_kcb + offset * stride_kct)[:, None, None] + hd * stride_kch + dd
    tl.store(k_cache_ptr + k_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + t64 * stride_vt + hd * stride_vh + dd, mask=mask)
    v_off = (block * stride_vcb + offset * stride_vct)[:, None, None] + hd * stride_vch + dd
    tl.store(v_cache_ptr + v_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key[t] and value[t] into slot slot_mapping[t] of k_cache and v_cache."""
    _, block_size, num_kv_heads, head_dim = envelope.check_cache("k_cache", k_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("v_cache must match k_cache in shape and dtype")
    envelope.check_last_contiguous("v_cache", v_cache)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, {num_kv_heads}, {head_dim}],"
            f" got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    envelope.check_dtype("key", key)
    envelope.check_dtype("value", value)
    envelope.check_last_contiguous("key", key)
    envelope.check_last_contiguous("value", value)
    envelope.check_index("slot_mapping", slot_mapping, 1, (torch.int64,))
    envelope.check_last_contiguous("slot_mapping", slot_mapping)
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    envelope.check_device(_reshape_and_cache_kernel, key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    heads_pad = triton.next_power_of_2(num_kv_heads)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # About 2K elements of K (and of V) per program.
    block_t = max(1, min(64, 2048 // (heads_pad * head_dim_pad)))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key_ptr=key,
        value_ptr=value,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        stride_kt=key.stride(0),
        stride_kh=key.stride(1),
        stride_vt=value.stride(0),
        stride_vh=value.stride(1),
        stride_kcb=k_cache.stride(0),
        stride_kct=k_cache.stride(1),
        stride_kch=k_cache.stride(2),
        stride_vcb=v_cache.stride(0),
        stride_vct=v_cache.stride(1),
        stride_vch=v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=heads_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
    )
