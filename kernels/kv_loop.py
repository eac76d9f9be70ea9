"""The inner loop every paged-attention kernel shares: walk a sequence's keys through its block
table, tile by tile, and fold them into a running (online) softmax.

A tile holds TILE consecutive key positions, a whole number of cache blocks; each key looks up
its own block id, so a tile may span several blocks:

    key position p  ->  block_table[p // BLOCK_SIZE] (physical block), slot p % BLOCK_SIZE
    address         =   block * stride_block + slot * stride_slot + kv_head * stride_head + d

Block ids are widened to int64 before the multiply: block * stride_block passes 2^31 elements
in any pool over 4 GiB (fp16), and a 32-bit product would wrap.

Running state per query row r (fp32, log2 domain: scores are pre-multiplied by log2(e)):
    m[r] = max score so far, l[r] = sum of exp2(score - m[r]), acc[r] = sum of exp2(...) * v.
Row r attends keys in [start, row_end[r]); a row may see no key in a tile (causal mask), and
the exp2 arguments are kept finite for such rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_kv(
    acc,  # [M, HEAD_DIM_PAD] fp32
    m_i,  # [M] fp32
    l_i,  # [M] fp32
    q,  # [M, HEAD_DIM_PAD] cache dtype, zero beyond head_dim
    row_end,  # [M] int32: row r attends keys [start, row_end[r])
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    table_ptr,  # [max_blocks] int32: this sequence's row of the block table
    kv_head,
    start,
    end,  # keys [start, end) are loaded; end >= every row_end
    scale,  # softmax scale * log2(e)
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    for t0 in range(start, end, TILE):
        key = t0 + offs_t
        key_mask = key < end
        block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        slot = key % BLOCK_SIZE
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k_off = block * stride_kb + slot * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, TILE]
        s = tl.where(key[None, :] < row_end[:, None], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = block * stride_vb + slot * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
