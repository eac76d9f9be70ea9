"""A fix to the Triton interpreter (triton 3.9, TRITON_INTERPRET=1) that the kernels' CPU runs
need; it changes nothing on a GPU, where it is never applied.

The interpreter stores bfloat16 values as their raw uint16 bits and its tl.dot multiplies those
bits as integers, so any bf16 dot is garbage. Here a bf16 operand is widened to fp32 (exact:
bf16 is the top half of an fp32) before the product, accumulating in fp32 as a GPU's bf16 MMA
does. Its casts from fp32 to bf16 still truncate where a GPU rounds to nearest even: CPU bf16
results can differ from a GPU's by one bf16 ulp.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton.language as tl

_applied = False


def _widen_bf16(handle: Any) -> Any:
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = np.asarray(handle.data, dtype=np.uint16).astype(np.uint32) << 16
    return TensorHandle(bits.view(np.float32), tl.float32)


def apply() -> None:
    """Idempotent; call only when the interpreter is enabled."""
    global _applied
    if _applied:
        return
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def create_dot_bf16(self: Any, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        return create_dot(self, _widen_bf16(a), _widen_bf16(b), *args, **kwargs)

    InterpreterBuilder.create_dot = create_dot_bf16
    _applied = True
