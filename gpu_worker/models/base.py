"""The contracts a model is built against: the attention backend that owns the KV cache
(`AttentionFn`) and, under tensor parallelism, its rank's group (`TensorParallel`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gpu_worker.models.shard import Shard

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`attn(layer_idx, q, k, v) -> out`, called once per decoder layer, in layer order.

Tokens of all sequences in the step are flattened into one dimension `T` (no batch dimension,
no padding); the backend knows from its own step metadata which sequence and position each
token belongs to.

* `layer_idx`: 0-based decoder layer index, selecting that layer's KV cache.
* `q`: `[T, num_heads, head_dim]`
* `k`, `v`: `[T, num_kv_heads, head_dim]` -- this step's new keys and values, which the backend
  writes into its cache before attending.
* returns `[T, num_heads, head_dim]` in the dtype of `q`.

`q` and `k` already carry rotary embedding (and Qwen3's per-head q/k RMSNorm). The backend
applies causal masking over each sequence's cached context plus its new tokens, grouped-query
sharing (`num_heads // num_kv_heads` query heads per KV head) and the softmax scale
`head_dim ** -0.5`.

`q`, `k` and `v` are views into one fused projection: the last dimension is contiguous but
the token stride is larger than `num_heads * head_dim`. A kernel that needs packed memory calls
`.contiguous()` itself; the backend must not write into them.
"""


class TensorParallel(Protocol):
    """One rank's tensor-parallel group as the model and its runner see it
    (`gpu_worker.parallel.group.TPGroup` is the one that runs): what the rank holds, and the
    collectives of a step. Every rank calls each collective in the same order, with tensors of
    the same shape."""

    @property
    def shard(self) -> Shard:
        """What this rank holds of the model."""
        ...

    @property
    def samples(self) -> bool:
        """Whether this rank samples (rank 0); the others take its tokens."""
        ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place, and returns it."""
        ...

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """`[R, vocab_rows]` on each rank -> `[R, vocab]` on each rank."""
        ...

    def broadcast_tokens(self, token_ids: list[int] | None, count: int) -> list[int]:
        """Rank 0's `count` sampled token ids (None on the other ranks), on every rank."""
        ...
