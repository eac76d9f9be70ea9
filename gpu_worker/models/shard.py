"""What one tensor-parallel rank holds of a llama-family model: its heads, intermediate
columns and vocabulary rows, and its slice of each checkpoint tensor (by HF name). The group
that runs the ranks is `gpu_worker.parallel`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from gpu_worker.models.config import ModelConfig


class TensorParallelError(ValueError):
    """The model cannot be split this way (said in one line, before anything starts)."""


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds: its query heads, KV heads (several ranks hold the same
    one when size exceeds the KV heads, as vLLM replicates them), intermediate columns and
    vocabulary rows (the last rank's padded with zero rows when the vocabulary does not
    divide)."""

    rank: int
    size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate: int
    vocab_rows: int
    vocab_size: int

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, size: int) -> Shard:
        h, kv, n = config.num_attention_heads, config.num_key_value_heads, size
        if h % n:
            raise TensorParallelError(
                f"the model's {h} attention heads do not split over tensor-parallel size {n}"
            )
        if kv % n and n % kv:
            raise TensorParallelError(
                f"the model's {kv} KV heads do not split over tensor-parallel size {n} "
                "(nor does the size split over them)"
            )
        if config.intermediate_size % n:
            raise TensorParallelError(
                f"the model's intermediate size {config.intermediate_size} does not split over "
                f"tensor-parallel size {n}"
            )
        local_kv = max(1, kv // n)
        return cls(
            rank=rank,
            size=n,
            head_dim=config.head_dim,
            num_heads=h // n,
            num_kv_heads=local_kv,
            kv_head_start=rank * local_kv if kv >= n else rank * kv // n,
            intermediate=config.intermediate_size // n,
            vocab_rows=-(-config.vocab_size // n),
            vocab_size=config.vocab_size,
        )

    def layer_config(self, config: ModelConfig) -> ModelConfig:
        """The config a decoder layer of this shard is built from."""
        return replace(
            config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def slice(self, name: str, src: Any) -> torch.Tensor:
        """This shard's part of checkpoint tensor `name`; `src` is the tensor or a lazy slice
        of it (safetensors' `get_slice`), indexed so that only the part is read."""
        d = self.head_dim
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = self.vocab_start
            rows = src[start : min(self.vocab_size, start + self.vocab_rows)]
            pad = self.vocab_rows - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
        if part == "q_proj":
            q0 = self.rank * self.num_heads * d
            return src[q0 : q0 + self.num_heads * d]
        if part in ("k_proj", "v_proj"):
            k0 = self.kv_head_start * d
            return src[k0 : k0 + self.num_kv_heads * d]
        if part == "o_proj":
            if name.endswith(".bias"):  # added once, by rank 0
                bias = src[:]
                return bias if self.rank == 0 else torch.zeros_like(bias)
            q0 = self.rank * self.num_heads * d
            return src[:, q0 : q0 + self.num_heads * d]
        if part in ("gate_proj", "up_proj"):
            i0 = self.rank * self.intermediate
            return src[i0 : i0 + self.intermediate]
        if part == "down_proj":
            i0 = self.rank * self.intermediate
            return src[:, i0 : i0 + self.intermediate]
        return src[:]
