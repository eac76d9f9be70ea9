"""Picks the attention backend for a device: triton on CUDA, torch on CPU by default.

The triton backend also runs on the CPU under TRITON_INTERPRET=1 (slow, for tests); without
it, asking for triton on the CPU fails at start-up with a message saying so.
"""

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
        # Imported here: it loads the Triton kernels, which read TRITON_INTERPRET at import.
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(cache, num_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
