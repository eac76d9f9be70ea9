"""Split-K paged decode: the context is cut into partitions that separate programs attend to,
and a second kernel merges the partial results by log-sum-exp.

With few sequences the one-pass kernel (kernels.paged_decode) launches only
num_seqs * num_kv_heads programs, each walking the whole context, and most of a GPU idles. Here
each (sequence, kv head, partition) program attends keys [p * P, (p + 1) * P) and writes, per
query head, its normalised partial output o_p and log2-sum-exp lse_p = m_p + log2(l_p). The
merge is exact:

    out = sum_p 2^(lse_p - M) * o_p / sum_p 2^(lse_p - M),   M = max_p lse_p

Layout (as kernels.paged_decode, plus fp32 scratch):
    partial_out  [num_seqs, num_q_heads, max_partitions, head_dim] fp32
    partial_lse  [num_seqs, num_q_heads, max_partitions] fp32
Partitions past a sequence's end write nothing, and the merge reads only the
cdiv(seq_len, P) partitions each sequence has.

Limits: kernels.envelope; the partition size is a multiple of the key tile; seq_lens >= 1.
`use_split_k` is the heuristic that picks this kernel over the one-pass one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import envelope
from kernels.kv_loop import attend_paged_kv
from kernels.paged_decode import LOG2E, check_decode_args

PARTITION_SIZE = 512


def use_split_k(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    partition_size: int = PARTITION_SIZE,
) -> bool:
    """Split when the one-pass grid cannot fill the device (fewer programs than two per SM) and
    the longest context spans more than two partitions; otherwise the second launch and the
    scratch traffic cost more than the parallelism gains."""
    return max_seq_len > 2 * partition_size and num_seqs * num_kv_heads < 2 * num_sms


@triton.jit
def _paged_decode_partition_kernel(
    partial_out_ptr,  # [num_seqs, num_q_heads, max_partitions, head_dim] fp32
    partial_lse_ptr,  # [num_seqs, num_q_heads, max_partitions] fp32
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale,  # softmax scale * log2(e)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    max_partitions,
    PARTITION_SIZE: tl.constexpr,
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
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(seq_len, start + PARTITION_SIZE)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * QUERIES_PER_KV + g
    row_mask = g < QUERIES_PER_KV
    mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    row_end = tl.zeros([GROUP_PAD], dtype=tl.int32) + end
    # fmt: off
    acc, m_i, l_i = attend_paged_kv(
        acc, m_i, l_i, q, row_end,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bts,
        kv_head, start, end, scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT_PRECISION,
    )
    # fmt: on
    # A partition past the end has l = 0; it stores nothing and the merge never reads it.
    live = (g * 0 + start) < seq_len  # [G]: a vector, as masks must be
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    row = (seq * tl.num_programs(1) * QUERIES_PER_KV + head) * max_partitions + part  # [G]
    tl.store(partial_lse_ptr + row, m_i + tl.log2(l_safe), mask=row_mask & live)
    out_ptrs = partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptrs, acc / l_safe[:, None], mask=mask & live[:, None])


@triton.jit
def _merge_partitions_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_q_heads, max_partitions, head_dim] fp32
    partial_lse_ptr,  # [num_seqs, num_q_heads, max_partitions] fp32
    seq_lens_ptr,  # [num_seqs] int32
    stride_os,
    stride_oh,
    max_partitions,
    PARTITIONS_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)

    p = tl.arange(0, PARTITIONS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = p < num_parts
    row = (seq * tl.num_programs(1) + head) * max_partitions + p  # [PARTITIONS_PAD]
    lse = tl.load(partial_lse_ptr + row, mask=p_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(p_mask, w, 0.0)
    mask = p_mask[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    out_ptrs = out_ptr + seq * stride_os + head * stride_oh + d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention_splitk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    partition_size: int = PARTITION_SIZE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as kernels.paged_decode.paged_decode_attention, computed by partitions.

    max_seq_len (>= every seq_len) sizes the grid; without it the launcher reads seq_lens back
    from the device, which synchronises.
    """
    block_size, group = check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, out)
    tile = envelope.kv_tile(block_size)
    if partition_size < tile or partition_size % tile:
        raise ValueError(f"partition_size {partition_size} must be a multiple of {tile}")
    envelope.check_device(_paged_decode_partition_kernel, q, k_cache, v_cache, block_tables)
    if out is None:
        out = torch.empty_like(q)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_parts = max(1, triton.cdiv(max_seq_len, partition_size))
    partial_out = torch.empty(
        (num_seqs, num_q_heads, max_parts, head_dim), dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty(
        (num_seqs, num_q_heads, max_parts), dtype=torch.float32, device=q.device
    )
    head_dim_pad = triton.next_power_of_2(head_dim)
    _paged_decode_partition_kernel[(num_seqs, num_kv_heads, max_parts)](
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        scale=scale * LOG2E,
        stride_qs=q.stride(0),
        stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0),
        stride_kt=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vt=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bts=block_tables.stride(0),
        max_partitions=max_parts,
        PARTITION_SIZE=partition_size,
        QUERIES_PER_KV=group,
        GROUP_PAD=max(envelope.MIN_DOT, envelope.group_pad(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=tile,
        DOT_PRECISION=envelope.dot_precision(q.dtype),
    )
    _merge_partitions_kernel[(num_seqs, num_q_heads)](
        out_ptr=out,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        seq_lens_ptr=seq_lens,
        stride_os=out.stride(0),
        stride_oh=out.stride(1),
        max_partitions=max_parts,
        PARTITIONS_PAD=triton.next_power_of_2(max_parts),
        PARTITION_SIZE=partition_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
    )
    return out
