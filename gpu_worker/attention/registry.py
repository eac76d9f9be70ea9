"""Picks the attention backend for a device: triton on CUDA, torch on CPU by default."""

from __future__ import annotations

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.kv_cache import KVCache

BACKENDS = ("torch", "triton")


def default_backend(device: str) -> str:
    return "triton" if device.startswith("cuda") else "torch"


def create_backend(
    name: str | None, cache: KVCache, num_heads: int, head_dim: int, device: str
) -> AttentionBackend:
    name = name or default_backend(device)
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(cache, num_heads, head_dim)
    if name == "triton":
        raise ValueError(
            "attention backend 'triton' is not available in this build; use --attention-backend"
            " torch"
        )
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
