"""Slow, obviously correct torch references for the Triton kernels, and the fixtures' builders.

The references walk block tables one key position at a time, attend one query token at a time
and compute softmax in float64: nothing shared with the kernels but the layout.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

# Kernels run on a GPU when there is one and the interpreter is off; on the CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() and not triton.knobs.runtime.interpret else "cpu"


def ref_gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows 0..length-1 of one sequence, [length, num_kv_heads, head_dim], via its block table."""
    block_size = cache.shape[1]
    rows = [cache[int(table[p // block_size]), p % block_size] for p in range(length)]
    return torch.stack(rows)


def ref_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """q [num_tokens, num_q_heads, head_dim] of a varlen batch (sequence s owns query_lens[s]
    consecutive rows); new token i of s sits at position seq_len - q_len + i and sees keys
    0..that position. Returns float64, on the CPU."""
    q, k_cache, v_cache, block_tables = (t.cpu() for t in (q, k_cache, v_cache, block_tables))
    num_q_heads = q.shape[1]
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for s, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        keys = ref_gather(k_cache, block_tables[s], seq_len).double()
        values = ref_gather(v_cache, block_tables[s], seq_len).double()
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            qi = q[row + i].double()  # [num_q_heads, head_dim]
            scores = torch.einsum("hd,khd->hk", qi, keys[:visible]) * scale
            weights = torch.softmax(scores, dim=-1)
            out[row + i] = torch.einsum("hk,khd->hd", weights, values[:visible])
        row += q_len
    return out


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place, on any device; one token at a time."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]


def ref_copy_blocks(caches: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    for c in range(caches.shape[0]):
        for src, dst in pairs:
            caches[c, dst] = caches[c, src].clone()


def huge_kv_pool(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(k_cache, v_cache, big): caches whose blocks from id `big` on sit more than 2^32
    elements past the start, K and V interleaved per block like the worker's pool.

    With 32-bit offset arithmetic block * stride_block would wrap to a small, valid offset, so
    a kernel that forgot to widen reads the wrong block and fails an equality check cleanly
    instead of faulting. The pool reserves ~8 GiB of fp16 address space, but torch.empty does
    not touch it: only the pages of the blocks a test writes get memory (on a GPU it is real).
    """
    block = (block_size, num_kv_heads, head_dim)
    stride_block = 2 * math.prod(block)
    big = (1 << 32) // stride_block
    pool = torch.empty((big + 4, 2, *block), dtype=dtype, device=DEVICE)
    return pool[:, 0], pool[:, 1], big


@dataclass
class PagedBatch:
    """A varlen batch over a randomly paged cache whose K/V are already written."""

    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_lens_host: list[int]
    seq_lens_host: list[int]
    scale: float

    def reference(self) -> torch.Tensor:
        return ref_paged_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_lens_host,
            self.seq_lens_host,
            self.scale,
        )


def make_batch(
    seqs: Sequence[tuple[int, int]],
    *,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """seqs: (cached context length, new tokens) per sequence. Physical blocks are a random
    permutation, so no sequence's blocks are contiguous or in order."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    q_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(blocks_per_seq)
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_q_heads = num_kv_heads * queries_per_kv
    q = torch.randn((sum(q_lens), num_q_heads, head_dim), generator=gen).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        q=q.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
        scale=head_dim**-0.5,
    )
