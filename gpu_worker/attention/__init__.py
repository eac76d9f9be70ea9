"""Attention backends: write the step's K/V into the paged cache and attend over it."""

from gpu_worker.attention.base import AttentionBackend, BatchLayout
from gpu_worker.attention.registry import create_backend

__all__ = ["AttentionBackend", "BatchLayout", "create_backend"]
