"""copy_blocks: copy whole KV blocks src -> dst in every cache at once (copy-on-write).

The worker's pool is one tensor [layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
flattened to caches [layers * 2, num_blocks, ...] each (cache, pair) program copies one block
of one cache in CHUNK-element pieces. A block's elements must be contiguous (the pool's own
layout); block and cache strides are free.

Layout:
    caches         [num_caches, num_blocks, *block_shape]   (block_shape elements contiguous)
    block_mapping  [num_pairs, 2] int64                       (src block, dst block)

Offsets are int64: cache * stride_cache alone passes 2^31 elements in any pool over 4 GiB.
A dst block must not also be a src in the same call (copy-on-write never does that); the
copies then commute and one launch does them all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import envelope


@triton.jit
def _copy_blocks_kernel(
    caches_ptr,  # [num_caches, num_blocks, block_numel]
    block_mapping_ptr,  # [num_pairs, 2] int64
    stride_cache,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1).to(tl.int64)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = caches_ptr + cache * stride_cache
    offs = tl.arange(0, CHUNK)
    for i in range(0, BLOCK_NUMEL, CHUNK):
        mask = i + offs < BLOCK_NUMEL
        x = tl.load(base + src * stride_block + i + offs, mask=mask)
        tl.store(base + dst * stride_block + i + offs, x, mask=mask)


def copy_blocks(caches: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies block src to block dst of every cache, for each (src, dst) row of block_mapping."""
    if caches.dim() < 3:
        raise ValueError(f"caches must be [num_caches, num_blocks, ...], got {caches.shape}")
    envelope.check_dtype("caches", caches)
    envelope.check_index("block_mapping", block_mapping, 2, (torch.int64,))
    if block_mapping.shape[1] != 2 or not block_mapping.is_contiguous():
        shape = tuple(block_mapping.shape)
        raise ValueError(f"block_mapping must be a contiguous [num_pairs, 2], got {shape}")
    block = caches[0, 0]
    if not block.is_contiguous():
        raise ValueError(f"a block's elements must be contiguous, got strides {caches.stride()}")
    envelope.check_device(_copy_blocks_kernel, caches, block_mapping)
    num_caches, num_pairs = caches.shape[0], block_mapping.shape[0]
    if num_pairs == 0 or num_caches == 0:
        return
    block_numel = block.numel()
    _copy_blocks_kernel[(num_pairs, num_caches)](
        caches_ptr=caches,
        block_mapping_ptr=block_mapping,
        stride_cache=caches.stride(0),
        stride_block=caches.stride(1),
        BLOCK_NUMEL=block_numel,
        CHUNK=min(4096, triton.next_power_of_2(block_numel)),
    )
