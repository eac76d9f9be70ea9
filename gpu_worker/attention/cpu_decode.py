"""The CPU decode kernel (`csrc/paged_decode_cpu.c`): build, load and call.

Decode attention over a paged cache in torch has to gather every sequence's context into a
padded copy per layer and step, then run SDPA over it; on a CPU that copy and the padded SDPA
cost several times the one pass over the context this kernel makes, reading K/V in place
through the block table.

The C source is compiled once per machine with the system C compiler (`cc`, or `$CC`) into a
cache directory (`$PAGEDSERVE_CACHE_DIR/kernels`, default `~/.cache/pagedserve/kernels`), keyed by a
hash of the source, flags, compiler and the CPU's instruction-set flags (`-march=native` code
from one CPU can die with SIGILL on another that shares the cache: an image, an NFS home), and
loaded with ctypes (calls release the GIL). OpenMP
resolves to the libgomp torch has already loaded, so the kernel shares torch's threads.

`load()` returns None, and the torch backend keeps its SDPA path, when the kernel is disabled
(`PAGEDSERVE_CPU_DECODE_KERNEL=0`) or cannot be built here.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from pagedserve.log import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
TILE = 16  # head sizes must be a multiple of it (TILE in the C source)
MAX_HEAD_DIM = 256  # MAX_HEAD_DIM in the C source

_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # "fn": the ctypes function, or None


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "pagedserve") / "kernels"


def cpu_features() -> str:
    """What `-march=native` compiles for: the CPU's feature flags (sorted), else its name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm64
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def library_path(cc: str) -> Path:
    """Where the kernel built by `cc` for this source, flags and CPU lives in the cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                SOURCE.read_bytes(),
                " ".join(CFLAGS).encode(),
                version.encode(),
                cpu_features().encode(),
            ]
        )
    ).hexdigest()[:16]
    return _cache_dir() / f"paged_decode_cpu-{key}.so"


def _build(cc: str) -> Path:
    target = library_path(cc)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent workers never see half a library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size (every Llama-family size does: 64, 128, ...)."""
    return head_dim % TILE == 0 and TILE <= head_dim <= MAX_HEAD_DIM


def load() -> Any:
    """The kernel's entry point, built on first use; None where it is off or cannot build."""
    with _lock:
        if "fn" in _loaded:
            return _loaded["fn"]
        fn = None
        if os.environ.get("PAGEDSERVE_CPU_DECODE_KERNEL", "1") != "0":
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                log.warning("cpu_decode_kernel_unavailable", reason="no C compiler found")
            else:
                try:
                    fn = ctypes.CDLL(str(_build(cc))).paged_decode_f32
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = getattr(exc, "stderr", "") or str(exc)
                    log.warning("cpu_decode_kernel_unavailable", reason=detail[-500:])
        if fn is not None:
            fn.restype = ctypes.c_int
            p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
            fn.argtypes = [p, i64, p, p, p, p, i64, p, p, *[i32] * 6, f32, i32]
        _loaded["fn"] = fn
        return fn


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

    out [T, H, D] float32 contiguous, D a size `supports` takes; q [T, H, D] float32 with
    each token's heads contiguous (any token stride); rows [S] int64; k_cache, v_cache
    [num_blocks, block_size, KV, D] float32 contiguous; block_tables [S, W] int32 contiguous;
    seq_lens [S] int32 (context including the new token, whose K/V must already be in the
    cache); max_len >= seq_lens.
    """
    fn = load()
    assert fn is not None, "the CPU decode kernel is not available"
    num_seqs = rows.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    assert kv_dim == head_dim and num_heads % num_kv_heads == 0 and supports(head_dim)
    for t in (out, q, k_cache, v_cache):
        assert t.dtype == torch.float32 and t.device.type == "cpu"
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
    )
    if failed == 1:
        raise MemoryError("the CPU decode kernel could not allocate its scratch space")
    if failed:
        raise ValueError(f"paged_decode: bad arguments (code {failed}; see the C source)")
