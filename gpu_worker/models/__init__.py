"""Decoder-only models: configuration parsed from HF checkpoints, rotary embedding, the decoder.

One implementation (`llama.CausalLM`) covers Llama, Mistral, Qwen2 and Qwen3 layouts; it runs
over a flattened token batch and leaves attention (and the KV cache) to an `AttentionFn`.
"""

from gpu_worker.models.base import AttentionFn
from gpu_worker.models.config import ModelConfig, UnsupportedModelError
from gpu_worker.models.llama import CausalLM

__all__ = ["AttentionFn", "CausalLM", "ModelConfig", "UnsupportedModelError"]
