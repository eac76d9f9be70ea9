"""The default KV pool: sized from the host memory still available (within a cgroup's limit),
capped as vLLM's CPU build is, and reserved without being touched."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from gpu_worker import host_memory
from gpu_worker.build import _num_device_blocks
from gpu_worker.config import (
    DEFAULT_KV_CACHE_CAP,
    FALLBACK_KV_CACHE_MEMORY,
    WorkerConfig,
    default_kv_cache_memory,
)
from gpu_worker.kv_cache import CacheGeometry, KVCache
from pagedserve.plan import BlockMove

GiB = 1 << 30
MiB = 1 << 20


def test_the_default_pool_is_a_quarter_of_what_is_available_up_to_4_gib() -> None:
    assert default_kv_cache_memory(2 * GiB) == 512 * MiB
    assert default_kv_cache_memory(12 * GiB) == 3 * GiB
    assert default_kv_cache_memory(64 * GiB) == DEFAULT_KV_CACHE_CAP == 4 * GiB
    assert default_kv_cache_memory(0) == 0
    assert default_kv_cache_memory(None) == FALLBACK_KV_CACHE_MEMORY == GiB


def fake_host(
    tmp_path: Path, mem_available_kb: int, cgroup_line: str, files: dict[str, str]
) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       24683784 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {mem_available_kb} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


def test_available_memory_is_mem_available_without_a_cgroup_limit(tmp_path: Path) -> None:
    proc, root = fake_host(
        tmp_path,
        8 * 1024 * 1024,
        "0::/user.slice",
        {"user.slice/memory.max": "max\n", "user.slice/memory.current": "123\n"},
    )
    assert host_memory.available_bytes(proc, root) == 8 * GiB
    assert host_memory.available_bytes(tmp_path / "nowhere", root) is None


def test_a_cgroup_v2_limit_leaves_its_limit_less_usage_with_inactive_cache_free(
    tmp_path: Path,
) -> None:
    # A container limited to 2 GiB, 1.5 GiB used of which 0.5 GiB is cache the kernel drops.
    proc, root = fake_host(
        tmp_path,
        16 * 1024 * 1024,
        "0::/",
        {
            "memory.max": f"{2 * GiB}\n",
            "memory.current": f"{3 * GiB // 2}\n",
            "memory.stat": f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
        },
    )
    assert host_memory.available_bytes(proc, root) == GiB


def test_a_cgroup_v1_limit_counts_too(tmp_path: Path) -> None:
    proc, root = fake_host(
        tmp_path,
        16 * 1024 * 1024,
        "4:memory:/docker/abc\n0::/",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{3 * GiB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
            "memory/docker/abc/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert host_memory.available_bytes(proc, root) == 2 * GiB
    unlimited = str(9223372036854771712)
    (root / "memory/docker/abc/memory.limit_in_bytes").write_text(unlimited)
    assert host_memory.available_bytes(proc, root) == 16 * GiB


def test_without_kv_cache_memory_a_cpu_pool_is_sized_from_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole = CacheGeometry(30, 3, 64, 16, torch.float32)  # SmolLM2-135M in float32
    cfg = WorkerConfig(model="m")
    for available, budget in ((2 * GiB, 512 * MiB), (20 * GiB, 4 * GiB), (None, GiB)):
        monkeypatch.setattr(host_memory, "available_bytes", lambda a=available: a)
        assert _num_device_blocks(cfg, whole, whole, None, 9) == (  # type: ignore[arg-type]
            budget // whole.bytes_per_block
        )
    # 4 GiB holds 256 of the longest prompts (256 tokens, 17 blocks) at once.
    assert (4 * GiB // whole.bytes_per_block) // 17 >= 256


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_the_host_pool_takes_memory_only_as_its_blocks_are_written() -> None:
    """A 1 GiB pool costs (almost) nothing until it is written, reads as zeros, and grows by
    what is written."""
    g = CacheGeometry(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)
    gc.collect()
    before = rss_bytes()
    cache = KVCache(g, GiB // g.bytes_per_block, 0, "cpu")
    assert cache.nbytes > GiB - g.bytes_per_block
    assert rss_bytes() - before < 64 * MiB
    k, v = cache.layer(2)
    assert not k[100:200].any() and not v[-5:].any()  # reading maps no memory either
    k[7:9] = 1.0
    v[7:9] = 2.0
    cache.copy_blocks([BlockMove(7, 500)])  # copy-on-write reads and writes it as any pool
    assert float(k[500].sum()) == 16 * 4 * 64 and float(v[500].mean()) == 2.0
    assert rss_bytes() - before < 64 * MiB
