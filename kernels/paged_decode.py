"""Paged attention for decode: one new query token per sequence, over its whole cached context.

One program per (sequence, kv head). It loads the query rows of every query head that shares the
kv head (GQA: QUERIES_PER_KV of them, padded to at least 16 rows for tl.dot), walks the
sequence's block table once, and folds each key tile into an fp32 online softmax
(kernels.kv_loop), so each K/V byte is read once per kv head, not once per query head.

Layout:
    q, out        [num_seqs, num_q_heads, head_dim]        (row s = sequence s's new token)
    k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables  [num_seqs, max_blocks] int32              (logical block -> physical block)
    seq_lens      [num_seqs] int32                          (context length, new token included)

The new token's K/V must already be in the cache (reshape_and_cache runs first).

Limits: kernels.envelope (dtypes, block sizes, head dims, GQA ratio); seq_lens >= 1. Long
contexts with few sequences leave most of a GPU idle here: see kernels.paged_decode_splitk.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import envelope
from kernels.kv_loop import attend_paged_kv

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale,  # softmax scale * log2(e)
    stride_os,
    stride_oh,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * QUERIES_PER_KV + g
    mask = (g < QUERIES_PER_KV)[:, None] & (d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    row_end = tl.zeros([GROUP_PAD], dtype=tl.int32) + seq_len
    # fmt: off
    acc, m_i, l_i = attend_paged_kv(
        acc, m_i, l_i, q, row_end,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bts,
        kv_head, 0, seq_len, scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT_PRECISION,
    )
    # fmt: on
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int]:
    """Validates decode inputs; returns (block_size, queries per kv head)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got {q.shape}")
    _, block_size, num_kv_heads, head_dim = envelope.check_cache("k_cache", k_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("v_cache must match k_cache in shape and dtype")
    envelope.check_last_contiguous("v_cache", v_cache)
    num_seqs, num_q_heads, q_dim = q.shape
    if q_dim != head_dim or q.dtype != k_cache.dtype:
        raise ValueError(
            f"q {q.dtype} [.., {q_dim}] must match the cache {k_cache.dtype} [.., {head_dim}]"
        )
    envelope.check_last_contiguous("q", q)
    group = envelope.check_heads(num_q_heads, num_kv_heads)
    envelope.check_index("block_tables", block_tables, 2, (torch.int32,))
    envelope.check_index("seq_lens", seq_lens, 1, (torch.int32,))
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError("block_tables and seq_lens need one row per sequence of q")
    envelope.check_last_contiguous("block_tables", block_tables)
    envelope.check_last_contiguous("seq_lens", seq_lens)
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError("out must match q in shape and dtype")
        envelope.check_last_contiguous("out", out)
    return block_size, group


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [num_seqs, num_q_heads, head_dim] over the paged cache."""
    block_size, group = check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, out)
    tensors = [q, k_cache, v_cache, block_tables, seq_lens]
    envelope.check_device(_paged_decode_kernel, *tensors)
    if out is None:
        out = torch.empty_like(q)
    num_seqs, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out_ptr=out,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        scale=scale * LOG2E,
        stride_os=out.stride(0),
        stride_oh=out.stride(1),
        stride_qs=q.stride(0),
        stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0),
        stride_kt=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vt=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bts=block_tables.stride(0),
        QUERIES_PER_KV=group,
        GROUP_PAD=max(envelope.MIN_DOT, envelope.group_pad(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE=envelope.kv_tile(block_size),
        DOT_PRECISION=envelope.dot_precision(q.dtype),
    )
    return out
