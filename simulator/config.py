"""What one simulation run is configured with (kept free of heavy imports, for the CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from control_plane.config import DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES

Allocation = Literal["paged", "orca-max", "orca-pow2", "orca-oracle"]
Routing = Literal["kv-aware", "least-loaded", "round-robin"]
Preemption = Literal["recompute", "swap"]
ALLOCATIONS: tuple[str, ...] = ("paged", "orca-max", "orca-pow2", "orca-oracle")
ROUTINGS: tuple[str, ...] = ("kv-aware", "least-loaded", "round-robin")


@dataclass
class SimConfig:
    num_workers: int = 1
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: what the device's memory leaves (cost model)
    gpu_memory_utilization: float = 0.9
    swap_space_bytes: float = 4 * (1 << 30)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's
    long_prefill_token_threshold: int | None = None
    max_prefill_tokens_with_decodes: int | None = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES
    preemption: Preemption = "recompute"
    allocation: Allocation = "paged"
    routing: Routing = "kv-aware"
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    kv_sample_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")
