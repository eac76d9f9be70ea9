"""Paged attention for prefill and chunked prefill over a varlen batch.

Each sequence s contributes q_len new tokens (rows query_start_loc[s] .. query_start_loc[s+1]
of q) after ctx_len = seq_len - q_len cached ones. New token i sits at position ctx_len + i and
attends causally to keys 0 .. ctx_len + i: the cached prefix (a prefix-cache hit or earlier
chunks) and the new tokens up to itself. The step's new K/V are already in the cache
(reshape_and_cache runs first), so every key is read through the block table alike.

    keys:    | cached context (ctx_len)        | new tokens (q_len)       |
    query i:   sees all of it ................... sees new tokens 0 .. i

One program per (query tile, kv head). A query tile is BLOCK_Q consecutive new tokens of one
sequence, times the QUERIES_PER_KV query heads sharing the kv head (padded to a power of two),
so one K/V load serves BLOCK_Q * GROUP_PAD score rows. A host-side tile list (PrefillTiles,
built once per step) maps programs to (sequence, first token); a sequence with no tile (e.g. a
decode handled by kernels.paged_decode) is left untouched in out.

Layout:
    q, out           [num_tokens, num_q_heads, head_dim]
    k/v cache        [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables     [num_seqs, max_blocks] int32
    query_start_loc  [num_seqs + 1] int32
    seq_lens         [num_seqs] int32        (context after the step: cached + new)

Limits: kernels.envelope; seq_len >= q_len >= 1 for every tiled sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import envelope
from kernels.kv_loop import attend_paged_kv
from kernels.paged_decode import LOG2E

# Score rows per program (query tokens x grouped heads); 64 suits head dims up to 128.
BLOCK_M = 64


@dataclass(frozen=True)
class PrefillConfig:
    """The kernel's tile shape and launch: score rows per program, keys per inner-loop
    iteration (a whole number of cache blocks), warps per program and pipelining depth."""

    block_m: int
    tile: int
    num_warps: int
    num_stages: int


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def prefill_config(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
) -> PrefillConfig:
    """Hopper (compute capability 9.x), 16-bit caches, head dims up to 128: 128 score rows
    over 128-key tiles on 8 warps, two stages deep (on an H200, 32 query heads over 8 kv heads
    of 128, bf16: 1.06-1.12x the default from 2k to 8k tokens, level at 1k; the two stages'
    tiles take ~128 KiB of Hopper's 227 KiB of shared memory, more than GPUs with ~100 KiB
    have). Elsewhere (other GPUs, float32, wider heads, the interpreter) 64 rows over
    envelope.kv_tile keys on Triton's default 4 warps and 3 stages."""
    if (
        device.type == "cuda"
        and _compute_capability(device)[0] == 9
        and dtype.itemsize == 2
        and head_dim <= 128
    ):
        return PrefillConfig(128, max(128, block_size), 8, 2)
    return PrefillConfig(BLOCK_M, envelope.kv_tile(block_size), 4, 3)


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    tile_seq_ptr,  # [num_tiles] int32: the sequence of each query tile
    tile_start_ptr,  # [num_tiles] int32: the tile's first new token, counted in its sequence
    scale,  # softmax scale * log2(e)
    stride_ot,
    stride_oh,
    stride_qt,
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
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    q0 = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Row r = (new token q0 + r // GROUP_PAD, query head g = r % GROUP_PAD of this kv head).
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = q0 + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * QUERIES_PER_KV + g
    token = (q_begin + qi).to(tl.int64)
    mask = ((qi < q_len) & (g < QUERIES_PER_KV))[:, None] & (d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0)

    # Causal: row qi sees keys < ctx_len + qi + 1; the tile's last token bounds the loads.
    end = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)
    row_end = tl.minimum(ctx_len + qi + 1, end)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    # fmt: off
    acc, m_i, l_i = attend_paged_kv(
        acc, m_i, l_i, q, row_end,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bts,
        kv_head, 0, end, scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT_PRECISION,
    )
    # fmt: on
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class PrefillTiles:
    """The prefill kernel's work list: program i handles BLOCK_Q new tokens of sequence seq[i]
    from token start[i]. Built on the host once per step, shared by every layer."""

    seq: torch.Tensor  # [num_tiles] int32
    start: torch.Tensor  # [num_tiles] int32
    block_q: int

    @property
    def num_tiles(self) -> int:
        return int(self.seq.shape[0])


def block_q_for(queries_per_kv: int, block_m: int = BLOCK_M) -> int:
    return max(1, block_m // envelope.group_pad(queries_per_kv))


def plan_prefill_tiles(
    query_lens: Sequence[int],
    queries_per_kv: int,
    device: torch.device | str,
    min_query_len: int = 1,
    block_m: int = BLOCK_M,
) -> PrefillTiles:
    """Tiles for every sequence with at least min_query_len new tokens (2 leaves decodes out),
    of `block_m` score rows (prefill_config's for the launch they are meant for)."""
    block_q = block_q_for(queries_per_kv, block_m)
    seqs: list[int] = []
    starts: list[int] = []
    for s, n in enumerate(query_lens):
        if n >= min_query_len:
            firsts = range(0, n, block_q)
            seqs.extend([s] * len(firsts))
            starts.extend(firsts)
    return PrefillTiles(
        seq=torch.tensor(seqs, dtype=torch.int32, device=device),
        start=torch.tensor(starts, dtype=torch.int32, device=device),
        block_q=block_q,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: PrefillTiles | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every new token of a varlen batch over its sequence's paged context.

    tiles defaults to every sequence (built from query_start_loc, which synchronises).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {q.shape}")
    _, block_size, num_kv_heads, head_dim = envelope.check_cache("k_cache", k_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("v_cache must match k_cache in shape and dtype")
    envelope.check_last_contiguous("v_cache", v_cache)
    num_tokens, num_q_heads, q_dim = q.shape
    if q_dim != head_dim or q.dtype != k_cache.dtype:
        raise ValueError(
            f"q {q.dtype} [.., {q_dim}] must match the cache {k_cache.dtype} [.., {head_dim}]"
        )
    envelope.check_last_contiguous("q", q)
    group = envelope.check_heads(num_q_heads, num_kv_heads)
    envelope.check_index("block_tables", block_tables, 2, (torch.int32,))
    envelope.check_index("query_start_loc", query_start_loc, 1, (torch.int32,))
    envelope.check_index("seq_lens", seq_lens, 1, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            "block_tables needs num_seqs rows and query_start_loc num_seqs + 1 entries,"
            f" got {block_tables.shape[0]} and {query_start_loc.shape[0]} for {num_seqs}"
        )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc)):
        envelope.check_last_contiguous(name, t)
    envelope.check_last_contiguous("seq_lens", seq_lens)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q in shape and dtype, with a contiguous last axis")
    envelope.check_device(_paged_prefill_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    cfg = prefill_config(q.device, q.dtype, head_dim, block_size)
    if tiles is None:
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        tiles = plan_prefill_tiles(q_lens, group, q.device, block_m=cfg.block_m)
    elif tiles.block_q != block_q_for(group, cfg.block_m):
        raise ValueError(
            f"tiles were planned for block_q {tiles.block_q}, not this GQA ratio and config"
        )
    if tiles.num_tiles == 0 or num_tokens == 0:
        return out
    _paged_prefill_kernel[(tiles.num_tiles, num_kv_heads)](
        out_ptr=out,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        tile_seq_ptr=tiles.seq,
        tile_start_ptr=tiles.start,
        scale=scale * LOG2E,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0),
        stride_kt=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vt=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bts=block_tables.stride(0),
        QUERIES_PER_KV=group,
        GROUP_PAD=envelope.group_pad(group),
        BLOCK_Q=tiles.block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE=cfg.tile,
        DOT_PRECISION=envelope.dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
