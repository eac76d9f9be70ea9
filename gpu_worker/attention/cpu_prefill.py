"""The CPU kernel for causal attention of prompt chunks (`csrc/prefill_attention_cpu.c`): load
and call, for float32 or bfloat16 q, k and v (float32 arithmetic in both).

A prompt whose whole context is in the step attends only among its own new rows; a chunk after
cached context (a prefix-cache hit, a long prompt's later chunk, a resumed request) also
attends to the context's keys, which the kernel reads from the paged cache through the
sequence's block table, in the cache's dtype (`PagedContext`). Torch's CPU
SDPA computes that per sequence at a small fraction of the machine's multiply-add rate for
prompt lengths of a few hundred tokens (bf16 without AMX: 20-45 GFLOP/s at 64-512 tokens on a
2-core AVX-512 machine); this kernel widens each sequence's K and V to float32 once (bf16
keys stay bf16 pairs where the CPU has vdpbf16ps) and computes every query head's rows from
them, several rows sharing each load, all of the step's prefills in one call.
`gpu_worker.cpu_kernels` builds it (once per machine and CPU).

The kernel is written on 16-float vectors, one AVX-512 register. On a CPU without AVX-512
(AVX2's 8-float registers) it measured slower than SDPA from 64 tokens up (level at 32): on a
Zen 2, float32, 1.4-2x at 64-150 tokens and 2.3-3.3x at 600-2,048 (SDPA's blocked kernel
reaches 50-80 GFLOP/s there, this one ~20). `preferred()` says where it runs: by default where
the CPU has AVX-512; `PAGEDSERVE_CPU_PREFILL_KERNEL=1` runs it anywhere it builds, `=0`
nowhere.
`load()` returns None, and the torch backend keeps SDPA, when the kernel is disabled or cannot
be built here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker import cpu_isa, cpu_kernels, cpu_team
from gpu_worker.attention import cpu_decode
from pagedserve import envs

SOURCE = Path(__file__).with_name("csrc") / "prefill_attention_cpu.c"
ENTRY_POINTS = {torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16"}


class _PagedContext(ctypes.Structure):
    _fields_ = [
        ("ctx", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("block_size", ctypes.c_int32),
        ("cache_bf16", ctypes.c_int32),
    ]


ARGTYPES = {
    name: [*[ctypes.c_void_p, ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_void_p]
    + [ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int] * 3, ctypes.c_float, ctypes.c_int]
    + [ctypes.POINTER(_PagedContext), ctypes.c_void_p]
    for name in ENTRY_POINTS.values()
}
# The head sizes and dtypes the decode kernel takes (the same TILE and MAX_HEAD_DIM in C).
supports = cpu_decode.supports


def preferred(features: str | None = None) -> bool:
    """Whether fresh prompts go through the kernel rather than SDPA on this CPU (or one with
    `features`): `PAGEDSERVE_CPU_PREFILL_KERNEL` 1 or 0 where set, else whether it has
    AVX-512."""
    if (switch := envs.get().cpu_prefill_kernel) is not None:
        return switch
    return "avx512f" in (cpu_isa.cpu_features() if features is None else features).split()


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it is off or cannot build."""
    if envs.get().cpu_prefill_kernel is False:
        return None
    return cpu_kernels.load_entry_points(SOURCE, ARGTYPES)


def _token_rows(t: torch.Tensor) -> int:
    """The token stride of a [T, heads, D] tensor whose heads are contiguous in each token."""
    assert t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2], "heads not packed"
    return t.stride(0)


@dataclass
class PagedContext:
    """The cached keys before each segment: `ctx` [S] int32 of them, read from `k_cache`,
    `v_cache` [num_blocks, block_size, KV, D] (contiguous, float32 or bfloat16) through
    `block_tables` [S, W] int32 (contiguous)."""

    ctx: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    context: PagedContext | None = None,
) -> None:
    """Writes, for each segment s, rows starts[s] .. starts[s] + lens[s] - 1 of `out`: causal
    attention of those rows of q over the segment's cached keys (`context`; none without it)
    and the same rows of k and v.

    out [T, H, D] contiguous; q [T, H, D], k and v [T, KV, D], each token's heads contiguous
    (any token stride: views of a fused qkv projection do); starts, lens [S] int32 (segments
    within 0..T, lens >= 1); one dtype, float32 or bfloat16, for all four tensors.
    """
    lib = load()
    assert lib is not None, "the CPU prefill kernel is not available"
    fn = getattr(lib, ENTRY_POINTS[q.dtype])
    team = cpu_team.current()  # None: OpenMP
    gen = None if team is None else team.generation_for(lib, "prefill_attention_set_team")
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert supports(head_dim, q.dtype) and num_heads % num_kv_heads == 0
    assert k.shape[1:] == v.shape[1:] == (num_kv_heads, head_dim)
    for t in (out, k, v):
        assert t.dtype == q.dtype and t.device.type == "cpu"
    assert out.is_contiguous() and out.shape == q.shape
    assert starts.dtype == lens.dtype == torch.int32
    assert starts.is_contiguous() and lens.is_contiguous() and starts.shape == lens.shape
    pc = None
    if context is not None:
        kc, vc, tables, ctx = (
            context.k_cache,
            context.v_cache,
            context.block_tables,
            context.ctx,
        )
        assert kc.dtype == vc.dtype and supports(head_dim, kc.dtype)
        assert kc.shape == vc.shape and kc.shape[2:] == (num_kv_heads, head_dim)
        assert kc.is_contiguous() and vc.is_contiguous()
        assert tables.dtype == ctx.dtype == torch.int32
        assert tables.is_contiguous() and ctx.is_contiguous()
        assert tables.shape[0] == ctx.shape[0] == starts.shape[0]
        pc = _PagedContext(
            ctx.data_ptr(),
            kc.data_ptr(),
            vc.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            kc.shape[1],
            int(kc.dtype == torch.bfloat16),
        )
    failed = fn(
        q.data_ptr(),
        _token_rows(q),
        k.data_ptr(),
        _token_rows(k),
        v.data_ptr(),
        _token_rows(v),
        starts.data_ptr(),
        lens.data_ptr(),
        starts.shape[0],
        out.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        torch.get_num_threads(),
        None if pc is None else ctypes.byref(pc),
        None if gen is None else ctypes.byref(gen),
    )
    if team is not None and gen is not None:
        team.hold(gen.value, q, starts, lens, None if context is None else context.ctx)
    if failed == 1:
        raise MemoryError("the CPU prefill kernel could not allocate its scratch space")
    if failed:
        raise ValueError(f"prefill_attention: bad arguments (code {failed}; see the C source)")
