"""The decoder's elementwise steps, in torch or, for bfloat16 and float32 on a CPU, fused in C.

`TorchOps` is the reference: the same torch ops for every dtype (float64 keeps it).
`FusedCpuOps` runs `csrc/fused_ops_cpu.c`: each step one pass over memory computing in
float32 (a residual add and RMSNorm, 7 ops in torch; SiLU-and-multiply, 2; RoPE, 7), in bf16
rounded once where torch's bf16 ops widen, compute and round per op. Both follow one
interface:

    h, x = ops.add_rms_norm(h, delta, weight, eps)   h (+ delta), and its normed copy
    act = ops.silu_mul(gate_up)                       silu(gate) * up
    rope = ops.rope_for(positions, table)             once per step
    qk = ops.rotate(qk, rope)                         every layer
    logits, top = ops.widen_top(logits, k)            bf16 logits -> float32, top-k ids
    ops.refine_top(logits, top, hidden, head)         those logits recomputed in float32

The fused ops may write `h` and `qk` in place; the model hands them tensors nothing else
reads. `PAGEDSERVE_CPU_FUSED_OPS=0` keeps torch's ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpu_worker import cpu_kernels
from gpu_worker.models.rope import apply_rotary
from pagedserve import envs

SOURCE = Path(__file__).with_name("csrc") / "fused_ops_cpu.c"


class TorchOps:
    name = "torch"

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            h = h + delta
        return h, F.rms_norm(h, (h.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rope_for(self, positions: torch.Tensor, table: torch.Tensor) -> Any:
        half = table.shape[-1] // 2
        cos_sin = table[positions].unsqueeze(1)
        return cos_sin[..., :half], cos_sin[..., half:]

    def rotate(self, qk: torch.Tensor, rope: Any) -> torch.Tensor:
        cos, sin = rope
        return apply_rotary(qk, cos, sin)

    def widen_top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-precision logits `[R, V]` -> (the same in float32, the ids of each row's `k`
        largest `[R, k]`, in any order)."""
        wide = logits.float()
        return wide, wide.topk(k, dim=1).indices

    def refine_top(
        self, logits: torch.Tensor, top: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor
    ) -> None:
        """Writes into `logits` [R, V] (float32 or wider), at each row's ids `top` [R, k], the
        products of the half-precision `hidden` [R, H] and `head` rows [V, H], exact, summed
        in `logits`' dtype."""
        rows = head[top].to(logits.dtype)  # [R, k, H]
        exact = torch.bmm(rows, hidden.to(logits.dtype).unsqueeze(2)).squeeze(2)
        logits.scatter_(1, top, exact)


class FusedCpuOps(TorchOps):
    """bf16 or float32 tensors on the CPU; `lib` is the built `fused_ops_cpu.c`."""

    SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = self.SUFFIXES[dtype]
        self.name = f"fused-{suffix}"
        self.dtype = dtype
        self._add_rms_norm = getattr(lib, f"add_rms_norm_{suffix}")
        self._silu_mul = getattr(lib, f"silu_mul_{suffix}")
        self._rope = getattr(lib, f"rope_{suffix}")
        self._widen_top = lib.widen_top_bf16
        self._refine_top = lib.refine_top_bf16

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert h.dtype == weight.dtype == self.dtype and h.is_contiguous()
        if delta is not None:
            assert delta.dtype == self.dtype and delta.shape == h.shape
            delta = delta.contiguous()
        out = torch.empty_like(h)
        rows, hidden = h.shape
        self._add_rms_norm(
            h.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return h, out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        assert gate_up.dtype == self.dtype and gate_up.is_contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out

    def rope_for(self, positions: torch.Tensor, table: torch.Tensor) -> Any:
        assert table.dtype == self.dtype and table.is_contiguous()
        positions = positions.to(torch.int64).contiguous()
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < len(table):
            raise IndexError(f"positions must lie in [0, {len(table)})")
        return positions, table

    def rotate(self, qk: torch.Tensor, rope: Any) -> torch.Tensor:
        positions, table = rope
        tokens, heads, dim = qk.shape
        assert qk.dtype == self.dtype and qk.stride(2) == 1 and qk.stride(1) == dim
        assert table.shape[1] == dim and positions.shape[0] == tokens
        self._rope(
            qk.data_ptr(),
            qk.stride(0),
            positions.data_ptr(),
            tokens,
            heads,
            dim,
            table.data_ptr(),
            torch.get_num_threads(),
        )
        return qk

    def widen_top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dtype != torch.bfloat16:
            return super().widen_top(logits, k)
        assert logits.is_contiguous() and 0 < k <= logits.shape[1]
        rows, vocab = logits.shape
        wide = torch.empty(rows, vocab, dtype=torch.float32)
        top = torch.empty(rows, k, dtype=torch.int64)
        self._widen_top(
            logits.data_ptr(), wide.data_ptr(), top.data_ptr(), rows, vocab, k,
            torch.get_num_threads(),
        )  # fmt: skip
        return wide, top

    def refine_top(
        self, logits: torch.Tensor, top: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor
    ) -> None:
        if not (
            logits.dtype == torch.float32
            and hidden.dtype == head.dtype == torch.bfloat16
            and top.dtype == torch.int64
            and all(t.is_contiguous() for t in (logits, top, hidden, head))
        ):
            return super().refine_top(logits, top, hidden, head)
        (rows, vocab), k = logits.shape, top.shape[1]
        assert head.shape == (vocab, hidden.shape[1]) and top.shape[0] == hidden.shape[0] == rows
        self._refine_top(
            hidden.data_ptr(), head.data_ptr(), logits.data_ptr(), top.data_ptr(), rows, vocab,
            hidden.shape[1], k, torch.get_num_threads(),
        )  # fmt: skip


def load() -> ctypes.CDLL | None:
    """The built library with its argument types set; None where it cannot build."""
    lib = cpu_kernels.load(SOURCE)
    if lib is not None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        for suffix in FusedCpuOps.SUFFIXES.values():
            for name, argtypes in (
                ("add_rms_norm", [p, p, p, p, i64, i32, f32, i32]),
                ("silu_mul", [p, p, i64, i32, i32]),
                ("rope", [p, i64, p, i64, i32, i32, p, i32]),
            ):
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes = argtypes
                fn.restype = None
        lib.widen_top_bf16.argtypes = [p, p, p, i64, i64, i32, i32]
        lib.widen_top_bf16.restype = None
        lib.refine_top_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32, i32]
        lib.refine_top_bf16.restype = None
    return lib


def ops_for(dtype: torch.dtype, device: torch.device) -> TorchOps:
    """The fused ops for bf16 and float32 on a CPU where they build (and are not turned off),
    else torch's (float64 keeps torch's: it is the exactness oracle's dtype)."""
    if dtype in FusedCpuOps.SUFFIXES and device.type == "cpu" and envs.get().cpu_fused_ops:
        lib = load()
        if lib is not None:
            return FusedCpuOps(lib, dtype)
    return TorchOps()
