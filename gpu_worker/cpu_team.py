"""The worker's stall-free CPU team and the float32 projections that run on it
(`csrc/team_cpu.c`).

An OpenMP team ends each parallel region at a barrier, so when the gateway, the control plane
or a client takes the core of one of the model's threads, the other waits: on two cores a
streamed step then loses about twice the CPU the edge uses. In a team of helpers started here
the model's thread never waits for a helper that lost its core: it takes the helper's item back
and computes it itself (docs/architecture.md, "The CPU team"). The worker starts the team for a
float32 model on a CPU when its threads are bound one to a core and there are at most
MAX_THREADS of them; the float32 projections then run `gemm_f32` on the team and torch's own
ops run on the model's thread alone. Anywhere else (tests, in-process engines, bf16) nothing
changes: projections stay on oneDNN.

    start(helper_cpus)        helpers bound to those CPUs (-1: unbound); once per process
    active()                  whether the team runs
    taken_back()              items taken back from helpers so far
    pack(weight)              the weight's panels for linear (a 3-D float32 tensor)
    linear(x, panels, n, b)   x @ weight.T (+ b) on the team

`PAGEDSERVE_CPU_TEAM=0` keeps the OpenMP team and oneDNN.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from pathlib import Path

import torch

from gpu_worker import cpu_kernels

SOURCE = Path(__file__).with_name("csrc") / "team_cpu.c"
SWITCH = "PAGEDSERVE_CPU_TEAM"
# Measured on two cores; a larger team keeps OpenMP and oneDNN, whose blocking for many
# threads this kernel does not have.
MAX_THREADS = 4
# How long an idle helper spins before it sleeps: longer than the gaps between a step's
# products (elementwise ops, attention), shorter than a wait for the next plan.
SPIN_US = 100

_lib: ctypes.CDLL | None = None
# Inputs of products in which a helper lost an item it may still be reading: (generation,
# tensor), dropped once every helper has left that generation.
_held: deque[tuple[int, torch.Tensor]] = deque()


def _load() -> ctypes.CDLL | None:
    lib = cpu_kernels.load(SOURCE)
    if lib is None:
        return None
    lib.team_start.restype = ctypes.c_int
    lib.team_start.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.team_size.restype = ctypes.c_int
    lib.team_left_gen.restype = ctypes.c_uint64
    lib.team_taken_back.restype = ctypes.c_uint64
    lib.gemm_panel_width.restype = ctypes.c_int64
    lib.pack_f32.restype = None
    lib.pack_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.gemm_f32.restype = ctypes.c_uint64
    lib.gemm_f32.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return lib


def wanted(device: str, dtype: torch.dtype, threads: int, bound: bool) -> bool:
    """Whether a worker with these settings runs its float32 projections on the team."""
    return (
        os.environ.get(SWITCH, "1") != "0"
        and device == "cpu"
        and dtype == torch.float32
        and bound
        and 2 <= threads <= MAX_THREADS
    )


def start(helper_cpus: list[int], spin_us: int = SPIN_US, stall_us: int = 0) -> int:
    """Starts one helper per entry of `helper_cpus` (bound to that CPU, or unbound for -1);
    returns how many run (0 where the library cannot build). Call from the model's thread.
    `stall_us` (tests) pauses each helper that long after every item, as if it lost its core."""
    global _lib
    lib = _lib or _load()
    if lib is None or not helper_cpus:
        return 0
    cpus = (ctypes.c_int * len(helper_cpus))(*helper_cpus)
    started = int(lib.team_start(len(helper_cpus), cpus, spin_us, stall_us))
    _lib = lib if started else None
    return started


def active() -> bool:
    return _lib is not None


def taken_back() -> int:
    """Items the model's thread has taken back from a helper that lost its core."""
    return int(_lib.team_taken_back()) if _lib is not None else 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 `[N, K]` weight as `[ceil(N / width), K, width]` panels for `linear`."""
    assert _lib is not None
    n, k = weight.shape
    width = int(_lib.gemm_panel_width())
    w = weight.detach().to(torch.float32).contiguous()
    panels = torch.empty(-(-n // width), k, width, dtype=torch.float32)
    _lib.pack_f32(w.data_ptr(), n, k, panels.data_ptr())
    return panels


def linear(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x [M, K] @ weight.T (+ bias)` in float32 on the team, `panels` from `pack(weight)`."""
    assert _lib is not None
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    gen = _lib.gemm_f32(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        panels.data_ptr(),
        n,
        None if b is None else b.data_ptr(),
        out.data_ptr(),
    )
    if gen:
        _held.append((gen, x))
        if b is not None and b is not bias:  # a contiguous copy of this call's
            _held.append((gen, b))
    if _held:
        left = _lib.team_left_gen()
        while _held and _held[0][0] <= left:
            _held.popleft()
    return out
