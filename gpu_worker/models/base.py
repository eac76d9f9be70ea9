"""The contract between a model and the attention backend that owns the KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
