"""The attention-backend interface and the per-step batch layout every backend reads.

A step's tokens are flattened across sequences, without padding:

    tokens:      | seq 0: q_len 5 (prefill chunk) | seq 1: 1 (decode) | seq 2: 1 | ...
    query_start: 0                                5                   6         7
    seq_lens:    context length of each sequence AFTER this step (cached + new tokens)

Token i of sequence s sits at position seq_lens[s] - query_lens[s] + i and attends causally
to positions 0..that position of its own sequence, read from the cache through
block_tables[s] (logical block j -> physical block id). slot_mapping[t] is the flat cache
slot (block_id * block_size + offset) where token t's K/V are written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from gpu_worker.kv_cache import KVCache


@dataclass
class BatchLayout:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, rows padded with 0
    query_lens_host: list[int]  # the same lengths, on the host
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


class AttentionBackend(ABC):
    """Owns the paged-attention computation of one worker.

    Contract: `begin_step(layout)` is called once per step before the forward pass; then for
    every layer `forward(layer_idx, q, k, v)` with q [T, num_heads, head_dim] and k, v
    [T, num_kv_heads, head_dim] (rope applied) first writes k and v into their cache slots,
    then returns the attention output [T, num_heads, head_dim] with scale head_dim ** -0.5.
    """

    name: str

    def __init__(self, cache: KVCache, num_heads: int, head_dim: int) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def begin_step(self, layout: BatchLayout) -> None: ...

    @abstractmethod
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...
