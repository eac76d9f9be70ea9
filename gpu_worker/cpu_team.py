"""The worker's stall-free CPU team and the products that run on it (`csrc/team_cpu.c`).

An OpenMP team ends each parallel region at a barrier, so when the gateway, the control plane
or a client takes the core of one of the model's threads, the other waits: on two cores a
streamed step then loses about twice the CPU the edge uses. In a team of helpers started here
the model's thread never waits for a helper that lost its core: it takes the helper's item back
and computes it itself (docs/architecture.md, "The CPU team"). The worker starts the team on a
CPU when its threads are bound one to a core and there are at most MAX_THREADS of them, for a
float32 model, a bf16 one whose products are widened to float32 (a CPU without bf16 products),
or a bf16 one where the CPU has AVX512-BF16 (`wanted`): with AMX, the team's products run on
its tiles (`PAGEDSERVE_CPU_TEAM_AMX=0` keeps oneDNN's there). The projections then run
`gemm_f32` / `gemm_bf16` on the team, the attention kernels run their items on it, and torch's
own ops run on the model's thread alone. Anywhere else (tests, in-process engines) nothing
changes: projections stay on oneDNN.

    start(helper_cpus)        helpers bound to those CPUs (-1: unbound); once per process;
                              the running `CpuTeam`, which the worker keeps
    current()                 that team, None where none runs
    set_tiles(mode)           where bf16 products run: "off" (vdpbf16ps), "amx" (the CPU's
                              tiles) or "model" (a software model of them, for tests)

  A `CpuTeam`:
    taken_back()              items taken back from helpers so far
    pack(weight, dtype)       the weight's panels for linear (a 3-D tensor)
    linear(x, panels, n, b)   x @ weight.T (+ b) on the team
    generation_for(lib, set)  for another kernel's library: tells it the team (once) and
                              gives the out-parameter its calls return the generation in
    hold(gen, *inputs)        keeps a call's inputs while a helper may still read them

`PAGEDSERVE_CPU_TEAM=0` keeps the OpenMP team and oneDNN (pagedserve/envs.py).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from gpu_worker import cpu_isa, cpu_kernels
from pagedserve import envs

SOURCE = Path(__file__).with_name("csrc") / "team_cpu.c"
# Where the CPU has AMX, the team's bf16 products run on its tiles (csrc/amx_tiles.h); "0"
# keeps them on oneDNN's, on an OpenMP team ("model": a software model of the tiles, tests).
TILES_SWITCH = "PAGEDSERVE_CPU_TEAM_AMX"  # envs.Settings.cpu_team_amx
TILE_MODES = {"off": 0, "amx": 1, "model": 2}
REFUSED = 2**64 - 1  # what a product the library cannot compute returns
# Measured on two cores; a larger team keeps OpenMP and oneDNN, whose blocking for many
# threads this kernel does not have.
MAX_THREADS = 4
# How long an idle helper spins before it sleeps: longer than the gaps between a step's
# products (elementwise ops, attention), shorter than a wait for the next plan.
SPIN_US = 100
# Multiply-adds from which a torch op with no path on the team (`torch_threads`) runs on an
# OpenMP team as wide as this one: 7-13 ms on one core, a prompt of 600-700 tokens and up on
# the models here. Shorter ops keep to one thread: OpenMP's threads spin after a region, on
# the helpers' cores (at 2^25, which `small`'s W64 prompts of 210 tokens and up reach, its
# streamed rate was 2% lower in one A/B on a Zen 2, about this machine's noise).
WIDE_WORK = 1 << 28

_lib: ctypes.CDLL | None = None  # the library, loaded (helpers or not) on first use
_running: CpuTeam | None = None  # the team `start` started: the library runs one per process


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
    lib.team_left_gen.restype = ctypes.c_uint64
    lib.team_taken_back.restype = ctypes.c_uint64
    lib.gemm_panel_width.restype = ctypes.c_int64
    lib.pack_f32.restype = None
    lib.pack_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.pack_bf16.restype = None
    lib.pack_bf16.argtypes = lib.pack_f32.argtypes
    lib.gemm_bf16_supported.restype = ctypes.c_int
    lib.team_set_tiles.restype = ctypes.c_int
    lib.team_set_tiles.argtypes = [ctypes.c_int]
    lib.team_tile_faults.restype = ctypes.c_uint64
    lib.team_tiles.restype = ctypes.c_int
    for name in ("gemm_f32", "gemm_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_uint64
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
    return lib


def wanted(
    device: str, dtype: torch.dtype, threads: int, bound: bool, widened: bool = False
) -> bool:
    """Whether a worker with these settings runs its projections on the team: float32,
    bfloat16 whose products are widened to float32 (`widened`: a CPU without bf16 products),
    bfloat16 where the CPU has AVX512-BF16 but no AMX, or bfloat16 on the tiles
    `tiles_wanted()` names (which this then turns on for the team's products, where the CPU
    and the OS allow them; on AMX without them, oneDNN's tiles outrun the team's `vdpbf16ps`
    products several times over)."""
    if not envs.get().cpu_team or device != "cpu" or not bound:
        return False
    if not 2 <= threads <= MAX_THREADS:
        return False
    if dtype == torch.bfloat16:
        if widened:
            return True
        lib = _library()
        if lib is None:
            return False
        if mode := tiles_wanted():
            return set_tiles(mode) == mode
        return cpu_isa.bf16_isa() == "avx512_bf16" and bool(lib.gemm_bf16_supported())
    return dtype == torch.float32


def tiles_wanted() -> str | None:
    """The tiles a bf16 worker's team takes its products on (`TILES_SWITCH`): "amx" on a CPU
    with AMX unless the switch is "0" (oneDNN's tile products on an OpenMP team then), "model"
    where it is "model" (the software model of the tiles, on any CPU with AVX512-BF16:
    tests), else None."""
    switch = envs.get().cpu_team_amx
    if switch == "model":
        return "model"
    return "amx" if switch != "0" and cpu_isa.bf16_isa() == "amx_bf16" else None


def tiles_asked() -> str | None:
    """The tiles the switch names outright ("1" on a CPU with AMX, "model"), which a worker
    that runs no team says it leaves unused."""
    return tiles_wanted() if envs.get().cpu_team_amx in ("1", "model") else None


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib


def set_tiles(mode: str) -> str:
    """Where the team's bf16 products run from now on (`TILE_MODES`); returns the mode set:
    "off" where the one asked for is not available (no AMX, the OS refuses its state, a build
    without the intrinsics). Call between products."""
    lib = _library()
    if lib is None:
        return "off"
    return _tile_mode(int(lib.team_set_tiles(TILE_MODES[mode])))


def tiles() -> str:
    """Where the team's bf16 products run now (`set_tiles`)."""
    return _tile_mode(int(_lib.team_tiles())) if _lib is not None else "off"


def _tile_mode(value: int) -> str:
    return next(name for name, v in TILE_MODES.items() if v == value)


def tile_faults() -> int:
    """Tile operations the software model refused so far (where the CPU would fault)."""
    lib = _library()
    return int(lib.team_tile_faults()) if lib is not None else 0


class CpuTeam:
    """A running team: its library, its width (the model's thread and its helpers), and the
    inputs of products a helper may still read. The worker that starts it owns it; model and
    attention code reach it through `current()`, since the library runs one team per
    process."""

    def __init__(self, lib: ctypes.CDLL, width: int) -> None:
        self.lib = lib
        self.width = width
        # Inputs of products in which a helper lost an item it may still be reading:
        # (generation, tensor), dropped once every helper has left that generation.
        self._held: deque[tuple[int, torch.Tensor]] = deque()
        self._told: set[int] = set()  # ids of the kernel libraries told the entry points

    def taken_back(self) -> int:
        """Items the model's thread has taken back from a helper that lost its core."""
        return int(self.lib.team_taken_back())

    def pack(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An `[N, K]` weight as panels for `linear`, in `dtype`: float32 `[ceil(N / width),
        K, width]`, bfloat16 `[ceil(N / width), ceil(K / 2), 2 * width]` (pairs of k per
        column)."""
        n, k = weight.shape
        width = int(self.lib.gemm_panel_width())
        w = weight.detach().to(dtype).contiguous()
        if dtype == torch.bfloat16:
            panels = torch.empty(-(-n // width), -(-k // 2), 2 * width, dtype=dtype)
            self.lib.pack_bf16(w.data_ptr(), n, k, panels.data_ptr())
        else:
            panels = torch.empty(-(-n // width), k, width, dtype=torch.float32)
            self.lib.pack_f32(w.data_ptr(), n, k, panels.data_ptr())
        return panels

    def linear(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x [M, K] @ weight.T (+ bias)` on the team, in the panels' dtype (x and bias in it
        too), `panels` from `pack(weight, dtype)`."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=panels.dtype)
        b = None if bias is None else bias.contiguous()
        gemm = self.lib.gemm_bf16 if panels.dtype == torch.bfloat16 else self.lib.gemm_f32
        gen = gemm(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            panels.data_ptr(),
            n,
            None if b is None else b.data_ptr(),
            out.data_ptr(),
        )
        if gen == REFUSED:
            raise RuntimeError("the CPU team has no bf16 products on this CPU (no AVX512-BF16)")
        self.hold(gen, x, panels, b)
        return out

    def hold(self, gen: int, *inputs: torch.Tensor | None) -> None:
        """After a call that ran on the team and returned `gen`: keeps `inputs` alive while a
        helper may still read them (gen nonzero), and lets go of earlier calls' that no helper
        reads any more."""
        if gen:
            self._held.extend((gen, t) for t in inputs if t is not None)
        if self._held:
            left = self.lib.team_left_gen()
            while self._held and self._held[0][0] <= left:
                self._held.popleft()

    def generation_for(self, lib: ctypes.CDLL, set_team: str) -> ctypes.c_uint64:
        """For a call into another kernel library (csrc/team.h) that runs its items on the
        team: the out-parameter it writes its generation to (pass `ctypes.byref`, then `hold`
        the call's inputs with its value). The library is told the team's entry points
        (`team_run_items`, `team_left_gen`) through its `set_team` function once."""
        if id(lib) not in self._told:
            runner = ctypes.cast(self.lib.team_run_items, ctypes.c_void_p)
            left = ctypes.cast(self.lib.team_left_gen, ctypes.c_void_p)
            getattr(lib, set_team)(runner, left)
            self._told.add(id(lib))
        return ctypes.c_uint64(0)

    @contextlib.contextmanager
    def torch_threads(self, work: int) -> Iterator[None]:
        """Around a torch op of `work` multiply-adds that has no path on the team (prompt
        attention through SDPA): at least WIDE_WORK, torch's threads are as many as the
        team's for the op (OpenMP's threads bound to the same cores, whose helpers have no
        items meanwhile), else the model's thread alone, as everywhere."""
        if self.width < 2 or work < WIDE_WORK:
            yield
            return
        torch.set_num_threads(self.width)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def let_go(self, timeout_s: float = 1.0) -> None:
        """At exit, before the interpreter frees what `hold` keeps: waits (bounded) for
        helpers still computing a taken-back item to leave it."""
        end = time.monotonic() + timeout_s
        while self._held and time.monotonic() < end:
            self.hold(0)
            time.sleep(0.0005)


def start(helper_cpus: list[int], spin_us: int = SPIN_US, stall_us: int = 0) -> CpuTeam | None:
    """Starts one helper per entry of `helper_cpus` (bound to that CPU, or unbound for -1);
    returns the running team (None where none started: no helpers asked for, or the library
    cannot build). Call from the model's thread, once per process. `stall_us` (tests) pauses
    each helper that long on every item it claims, before computing it, as if it lost its
    core there."""
    global _running
    assert _running is None, "the CPU team runs once per process"
    lib = _library()
    if lib is None or not helper_cpus:
        return None
    cpus = (ctypes.c_int * len(helper_cpus))(*helper_cpus)
    started = int(lib.team_start(len(helper_cpus), cpus, spin_us, stall_us))
    if not started:
        return None
    _running = CpuTeam(lib, started + 1)
    atexit.register(_running.let_go)
    return _running


def current() -> CpuTeam | None:
    """The team this process runs, None where it runs none."""
    return _running


@contextlib.contextmanager
def torch_threads(work: int) -> Iterator[None]:
    """`CpuTeam.torch_threads` of the running team; no change where none runs."""
    if _running is None:
        yield
        return
    with _running.torch_threads(work):
        yield
