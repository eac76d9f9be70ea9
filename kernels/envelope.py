"""The envelope every kernel supports, and the checks their launchers share.

Envelope (each launcher raises ValueError outside it, naming the limit):

* dtypes: float16, bfloat16, float32 (queries and cache of one dtype; fp32 accumulation);
* block sizes: 8, 16, 32, 64, 128 tokens (powers of two, the worker's choices);
* head dims: multiples of 16 from 16 to 256 (a non-power-of-two one is padded and masked);
* GQA: num_q_heads a multiple of num_kv_heads, at most 32 query heads per kv head;
* the head_dim axis of every tensor is contiguous (stride 1); other strides are free;
* tensors on a CUDA device, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1 set
  before the kernel modules are imported; slow, for tests).
"""

from __future__ import annotations

import torch
import triton

from kernels import interpreter_compat

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZES = (8, 16, 32, 64, 128)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MAX_QUERIES_PER_KV = 32
# tl.dot needs every operand dimension to be at least 16 on CUDA.
MIN_DOT = 16


def interpreter_enabled() -> bool:
    """Whether kernels imported now are built for the Triton interpreter."""
    return bool(triton.knobs.runtime.interpret)


if interpreter_enabled():
    interpreter_compat.apply()


def is_interpreted(kernel: object) -> bool:
    """Whether a @triton.jit kernel was built for the interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not is_interpreted(kernel):
        raise ValueError(
            "Triton kernels need a CUDA device; on the CPU they run only under the Triton"
            " interpreter (set TRITON_INTERPRET=1 before importing kernels)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}")


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise ValueError(f"{name} dtype must be one of {allowed}, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != ndim or t.dtype not in dtypes:
        raise ValueError(f"{name} must be a {ndim}-d tensor of {dtypes}, got {t.dtype} {t.shape}")


def check_head_dim(head_dim: int) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0):
        raise ValueError(
            f"head_dim {head_dim} is outside the kernels' envelope (a multiple of 16 from"
            f" {MIN_HEAD_DIM} to {MAX_HEAD_DIM})"
        )


def check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size} is outside the kernels' envelope ({BLOCK_SIZES})"
        )


def check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """Returns the number of query heads per kv head."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    group = num_q_heads // num_kv_heads
    if group > MAX_QUERIES_PER_KV:
        raise ValueError(
            f"{group} query heads per kv head is outside the kernels' envelope"
            f" (at most {MAX_QUERIES_PER_KV})"
        )
    return group


def check_config(
    num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """Whole-model check, for a backend to fail at start-up rather than at the first step."""
    check_heads(num_q_heads, num_kv_heads)
    check_head_dim(head_dim)
    check_block_size(block_size)
    check_dtype("the model", torch.empty(0, dtype=dtype))


def check_cache(name: str, cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Checks a [num_blocks, block_size, num_kv_heads, head_dim] cache; returns its shape."""
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got {cache.shape}"
        )
    check_dtype(name, cache)
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    check_block_size(block_size)
    check_head_dim(head_dim)
    check_last_contiguous(name, cache)
    return num_blocks, block_size, num_kv_heads, head_dim


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last axis, got strides {t.stride()}")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to tf32 on CUDA: exact fp32 is what fp32 asks for."""
    return "ieee" if dtype == torch.float32 else "tf32"


def group_pad(queries_per_kv: int) -> int:
    return triton.next_power_of_2(queries_per_kv)


def kv_tile(block_size: int) -> int:
    """Keys per inner-loop iteration: a whole number of cache blocks and at least 32 keys (tl.dot
    wants >= 16), so a tile may span several blocks; each key looks up its own block id."""
    return max(block_size, 32)
