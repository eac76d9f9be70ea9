"""Structured output's masks applied to a step's logits: the tokens a request's matcher does
not allow next get -inf. The masks are filled by the grammar library (outside the GIL, on its
own threads) as bitmasks; float32 logits on the CPU take them through a small C kernel
(`csrc/token_mask_cpu.c`), anything else through torch."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from gpu_worker import cpu_kernels
from pagedserve.grammar import Matcher, token_bitmask, unpack_bitmask

SOURCE = Path(__file__).with_name("csrc") / "token_mask_cpu.c"


def _kernel() -> ctypes.CDLL | None:
    lib = cpu_kernels.load(SOURCE)
    if lib is not None and not lib.apply_token_mask_f32.argtypes:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.apply_token_mask_f32.argtypes = [p, i64, p, p, i32, i32, i32]
        lib.apply_token_mask_f32.restype = None
    return lib


def mask_logits(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Matcher]) -> None:
    """Sets to -inf, in place, the logits of row rows[i] that matchers[i] does not allow next
    (rows of terminated matchers are left alone)."""
    live = [(r, m) for r, m in zip(rows, matchers, strict=True) if not m.terminated]
    if not live:
        return
    vocab = logits.shape[1]
    bitmask = token_bitmask([m for _, m in live], vocab)
    index = torch.tensor([r for r, _ in live], dtype=torch.int64)
    lib = _kernel() if logits.device.type == "cpu" else None
    if lib is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        lib.apply_token_mask_f32(
            logits.data_ptr(),
            logits.stride(0),
            bitmask.data_ptr(),
            index.data_ptr(),
            len(live),
            vocab,
            torch.get_num_threads(),
        )
        return
    allowed = unpack_bitmask(bitmask, vocab).to(logits.device)
    index = index.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
