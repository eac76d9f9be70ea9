"""The worker's configuration: one frozen dataclass, built from flags/env in pagedserve.cli."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker import cpu_isa
from pagedserve.grpc_security import INSECURE, GrpcSecurity

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # for exactness tests on CPU
}
AUTO = "auto"


def auto_dtype(device: str) -> str:
    """`--dtype auto`: bfloat16 on CUDA (float16 where the GPU lacks bf16) and on CPUs with
    native bf16 arithmetic (AMX, AVX512-BF16, arm64 BF16), float32 on other CPUs, where bf16
    matmuls are emulated through float32 and gain nothing."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_isa.bf16_isa() else "float32"


# The CPU KV pool without --kv-cache-memory: this share of the host memory available once the
# weights are loaded, at most the cap (vLLM's CPU build reserves 4 GiB, VLLM_CPU_KVCACHE_SPACE).
# The share leaves room for activations, the swap pool, the other processes of `up` and other
# workers started on the same machine; the pool's pages are taken only as blocks are written
# (gpu_worker.kv_cache), so a worker that serves little costs little whatever its pool.
DEFAULT_KV_CACHE_SHARE = 0.25
DEFAULT_KV_CACHE_CAP = 4 << 30
# Where the available memory cannot be read (not Linux).
FALLBACK_KV_CACHE_MEMORY = 1 << 30


def default_kv_cache_memory(available: int | None) -> int:
    """Bytes of the CPU KV pool when --kv-cache-memory is not given: DEFAULT_KV_CACHE_SHARE of
    `available` (host bytes still free, None: unknown), at most DEFAULT_KV_CACHE_CAP;
    FALLBACK_KV_CACHE_MEMORY where it is unknown."""
    if available is None:
        return FALLBACK_KV_CACHE_MEMORY
    return min(DEFAULT_KV_CACHE_CAP, int(max(0, available) * DEFAULT_KV_CACHE_SHARE))


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 50061
    device: str = "cpu"
    dtype: str = "float32"  # or "auto" (auto_dtype)
    kv_cache_dtype: str = AUTO  # auto: the model's dtype
    block_size: int = 16
    # Bytes of the KV pool (the whole model's blocks). None: default_kv_cache_memory on CPU,
    # what gpu_memory_utilization leaves on CUDA.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9  # fraction of device memory on CUDA
    swap_space: int = 1 << 30  # bytes of host swap pool
    attention_backend: str | None = None  # None: triton on CUDA, torch on CPU
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048  # size of the profiling pass on CUDA
    num_threads: int | None = None
    # The team size of each step measured between the whole team and one thread fewer
    # (gpu_worker.team); set where the threads are bound (gpu_worker.affinity).
    adaptive_threads: bool = False
    # Niceness added to the model's threads once serving (gpu_worker.affinity.lower_threads).
    nice: int = 0
    warmup_batch_size: int = 128  # decode batch sizes whose CPU kernels are built at startup
    grpc_security: GrpcSecurity = INSECURE  # who may call it: token, TLS / mTLS
    tensor_parallel_size: int = 1  # rank processes sharing the model (gpu_worker/parallel/)

    def __post_init__(self) -> None:
        if self.dtype not in (AUTO, *DTYPES):
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in (AUTO, *DTYPES):
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {', '.join(DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if (self.kv_cache_memory is not None and self.kv_cache_memory <= 0) or self.swap_space < 0:
            raise ValueError("kv_cache_memory must be > 0 and swap_space >= 0")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.warmup_batch_size < 0:
            raise ValueError("warmup_batch_size must be >= 0")
        if not (1 <= self.tensor_parallel_size <= 64):
            raise ValueError(
                f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}"
            )
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    @property
    def model_dtype(self) -> str:
        """The dtype name the model runs in (`auto` resolved for this device)."""
        return auto_dtype(self.device) if self.dtype == AUTO else self.dtype

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype name (`auto`: the model's)."""
        return self.model_dtype if self.kv_cache_dtype == AUTO else self.kv_cache_dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.model_dtype]
