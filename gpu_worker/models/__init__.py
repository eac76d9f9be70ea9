"""Decoder-only models: configuration parsed from HF checkpoints, rotary embedding, the decoder.

One implementation (`llama.CausalLM`) covers Llama, Mistral, Qwen2 and Qwen3 layouts; it runs
over a flattened token batch and leaves attention (and the KV cache) to an `AttentionFn`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpu_worker.models.config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from gpu_worker.models.base import AttentionFn
    from gpu_worker.models.llama import CausalLM

__all__ = ["AttentionFn", "CausalLM", "ModelConfig", "UnsupportedModelError"]


def __getattr__(name: str) -> Any:
    # The decoder (and torch) load on first use: `pagedserve up` checks a checkpoint's
    # config.json with ModelConfig before it starts any process, without torch.
    if name == "CausalLM":
        from gpu_worker.models.llama import CausalLM

        return CausalLM
    if name == "AttentionFn":
        from gpu_worker.models.base import AttentionFn

        return AttentionFn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
