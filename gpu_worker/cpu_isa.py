"""What the host CPU's instruction set offers, as /proc/cpuinfo states it.

`--dtype auto` runs bfloat16 where the CPU computes it natively (AMX tiles or AVX512-BF16 dot
products on x86, the BF16 extension on arm64) and float32 elsewhere: without such instructions
oneDNN emulates bf16 matmuls through float32 and gains nothing. The CPU decode kernel's build
cache is keyed by the same flags (`cpu_features`).
"""

from __future__ import annotations

import functools
import platform

# Flags naming native bf16 arithmetic, best first: x86 AMX, x86 AVX-512, arm64.
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@functools.cache
def cpu_features() -> str:
    """The CPU's feature flags (sorted, space-separated), else its name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm64
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def bf16_isa(features: str | None = None) -> str | None:
    """The best native bf16 instruction set flag of this CPU (or of `features`), else None."""
    flags = set((cpu_features() if features is None else features).split())
    return next((f for f in BF16_FLAGS if f in flags), None)
