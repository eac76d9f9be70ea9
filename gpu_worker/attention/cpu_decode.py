"""The CPU decode kernel (`csrc/paged_decode_cpu.c`): load and call, for a float32 or a
bfloat16 KV cache (float32 arithmetic in both).

Decode attention over a paged cache in torch has to gather every sequence's context into a
padded copy per layer and step, then run SDPA over it; on a CPU that copy and the padded SDPA
cost several times the one pass over the context this kernel makes, reading K/V in place
through the block table. `gpu_worker.cpu_kernels` builds it (once per machine and CPU).

`load()` returns None, and the torch backend keeps its SDPA path, when the kernel is disabled
(`PAGEDSERVE_CPU_DECODE_KERNEL=0`) or cannot be built here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker import cpu_kernels, cpu_team
from pagedserve import envs

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
TILE = 16  # head sizes must be a multiple of it (TILE in the C source)
MAX_HEAD_DIM = 256  # MAX_HEAD_DIM in the C source
# The entry point for each dtype of q, cache and out.
ENTRY_POINTS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
ARGTYPES = {
    name: [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, *[_I32] * 6, _F32, _I32, _P]
    for name in ENTRY_POINTS.values()
}


def supports(head_dim: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel takes this head size (every Llama-family size does: 64, 128, ...)
    and this cache dtype (float32, bfloat16)."""
    return head_dim % TILE == 0 and TILE <= head_dim <= MAX_HEAD_DIM and dtype in ENTRY_POINTS


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it is off or cannot build."""
    if not envs.get().cpu_decode_kernel:
        return None
    return cpu_kernels.load_entry_points(SOURCE, ARGTYPES)


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> None:
    """Writes `out[rows[s]]` = attention of query `q[rows[s]]` over sequence s's context.

    out [T, H, D] contiguous, D a size `supports` takes; q [T, H, D] with each token's heads
    contiguous (any token stride); rows [S] int64; k_cache, v_cache [num_blocks, block_size,
    KV, D] contiguous; block_tables [S, W] int32 contiguous; seq_lens [S] int32 (context
    including the new token, whose K/V must already be in the cache); max_len >= seq_lens.
    out, q and the caches share one dtype, float32 or bfloat16.
    """
    lib = load()
    assert lib is not None, "the CPU decode kernel is not available"
    fn = getattr(lib, ENTRY_POINTS[k_cache.dtype])
    team = cpu_team.current()  # None: OpenMP
    gen = None if team is None else team.generation_for(lib, "paged_decode_set_team")
    num_seqs = rows.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    assert kv_dim == head_dim and num_heads % num_kv_heads == 0 and supports(head_dim)
    for t in (out, q, v_cache):
        assert t.dtype == k_cache.dtype and t.device.type == "cpu"
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.is_contiguous() and out.shape[1:] == q.shape[1:]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
    assert seq_lens.dtype == torch.int32 and rows.dtype == torch.int64
    assert block_tables.shape[0] == seq_lens.shape[0] == num_seqs
    failed = fn(
        q.data_ptr(),
        q.stride(0),
        rows.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max(max_len, 1),
        scale,
        torch.get_num_threads(),
        None if gen is None else ctypes.byref(gen),
    )
    if team is not None and gen is not None:
        team.hold(gen.value, q, rows, k_cache, v_cache, block_tables, seq_lens)
    if failed == 1:
        raise MemoryError("the CPU decode kernel could not allocate its scratch space")
    if failed:
        raise ValueError(f"paged_decode: bad arguments (code {failed}; see the C source)")
