"""The physical KV block pool of a worker, and its CPU swap pool.

One tensor holds every layer's keys and values:

    kv[layer, 0 (K) | 1 (V), block, slot_in_block, kv_head, head_dim]

so `kv[l, 0]` is layer l's key cache in the `[num_blocks, block_size, num_kv_heads, head_dim]`
layout the attention backends and kernels read, and one indexed copy moves a block of every
layer at once (swap and copy-on-write). Block ids are the control plane's; this module never
decides which block holds what.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from pagedserve.plan import BlockMove


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)


class KVCache:
    """The worker's KV pool (on the model's device) and swap pool (host memory)."""

    def __init__(
        self, geometry: CacheGeometry, num_gpu_blocks: int, num_cpu_blocks: int, device: str
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(
                "the KV cache budget leaves no room for a single block "
                "(raise --kv-cache-memory or --gpu-memory-utilization)"
            )
        g = geometry
        shape = (g.num_layers, 2, num_gpu_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.geometry = g
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.kv = _zeros(shape, g.dtype, device)
        cpu_shape = (g.num_layers, 2, num_cpu_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        pin = torch.device(device).type == "cuda"
        # Left uninitialised: a swap block is always written whole (a GPU block swapped out)
        # before it is read, and pages never written cost no memory, so an unused swap pool
        # (recompute preemption, the default) takes none.
        self.cpu_kv = torch.empty(cpu_shape, dtype=g.dtype, pin_memory=pin)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of one layer, each [num_blocks, block_size, heads, dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def swap_out(self, moves: list[BlockMove]) -> None:
        if moves:
            src, dst = _split(moves, self.kv.device)
            self.cpu_kv[:, :, dst.cpu()] = self.kv[:, :, src].to("cpu")

    def swap_in(self, moves: list[BlockMove]) -> None:
        if moves:
            src, dst = _split(moves, self.kv.device)
            self.kv[:, :, dst] = self.cpu_kv[:, :, src.cpu()].to(self.kv.device)

    def copy_blocks(self, moves: list[BlockMove]) -> None:
        if not moves:
            return
        if self.kv.device.type == "cuda":
            from kernels.copy_blocks import copy_blocks

            pairs = torch.tensor(moves, dtype=torch.long, device=self.kv.device)
            copy_blocks(self.kv.flatten(0, 1), pairs)
            return
        src, dst = _split(moves, self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor. On the host it is a private anonymous mapping, whose pages the kernel
    hands out zeroed on first write: a pool costs the memory of the blocks written so far, not
    of its size (torch.zeros writes every page: memory at once, and ~2 s per GiB at start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds a reference to the mapping, which is unmapped when the tensor goes.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _split(moves: list[BlockMove], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([m.src for m in moves], dtype=torch.long, device=device)
    dst = torch.tensor([m.dst for m in moves], dtype=torch.long, device=device)
    return src, dst
