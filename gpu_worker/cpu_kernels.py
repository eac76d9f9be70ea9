"""Builds and loads the worker's C sources for the CPU (the attention kernels, the fused ops).

Each source is compiled once per machine with the system C compiler (`cc`, or `$CC`) into a
cache directory (`$PAGEDSERVE_CACHE_DIR/kernels`, default `~/.cache/pagedserve/kernels`), keyed
by a hash of the source, flags, compiler and the CPU's instruction-set flags (`-march=native`
code from one CPU can die with SIGILL on another that shares the cache: an image, an NFS home),
and loaded with ctypes (calls release the GIL). OpenMP resolves to the libgomp torch has
already loaded, so the C code shares torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpu_worker import cpu_isa
from pagedserve import envs
from pagedserve.log import get_logger

log = get_logger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
# Headers the sources include (`#include "..."`): part of every library's cache key.
INCLUDE_DIR = Path(__file__).with_name("csrc")

_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}
_typed: set[int] = set()  # ids of the libraries load_entry_points has typed


def _cache_dir() -> Path:
    return envs.get().cache_root / "kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(cc: str, source: Path) -> Path:
    """Where `source` built by `cc` for these flags and this CPU lives in the cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))),
                " ".join(CFLAGS).encode(),
                version.encode(),
                cpu_isa.cpu_features().encode(),
            ]
        )
    ).hexdigest()[:16]
    return _cache_dir() / f"{source.stem}-{key}.so"


def _build(cc: str, source: Path) -> Path:
    target = library_path(cc, source)
    if target.exists():
        log.info("cpu_kernel_cached", source=source.name, path=str(target))
        return target
    log.info("cpu_kernel_compiling", source=source.name, compiler=cc)
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent workers never see half a library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *CFLAGS, f"-I{INCLUDE_DIR}", str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    seconds = round(time.perf_counter() - t0, 2)
    log.info("cpu_kernel_compiled", source=source.name, path=str(target), seconds=seconds)
    return target


def load(source: Path) -> ctypes.CDLL | None:
    """`source`'s library, built on first use; None (logged once) where it cannot build."""
    with _lock:
        if source in _loaded:
            return _loaded[source]
        lib = None
        cc = compiler()
        if cc is None:
            log.warning("cpu_kernel_unavailable", source=source.name, reason="no C compiler found")
        else:
            try:
                lib = ctypes.CDLL(str(_build(cc, source)))
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", "") or str(exc)
                log.warning("cpu_kernel_unavailable", source=source.name, reason=detail[-500:])
        _loaded[source] = lib
        return lib


def load_entry_points(source: Path, argtypes: dict[str, list[Any]]) -> ctypes.CDLL | None:
    """`source`'s library with the entry points named in `argtypes` typed (those arguments, an
    int status returned); None where the library cannot build here. Called on every kernel
    call: once loaded and typed, a dict lookup."""
    lib = _loaded.get(source) or load(source)
    if lib is not None and id(lib) not in _typed:
        for name, types in argtypes.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = types
        _typed.add(id(lib))
    return lib
