"""The prefix-cache and parallel-sampling benchmarks run (quick mode) and report sane numbers."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import parallel_sampling, prefix_cache


def test_prefix_cache_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "pc.json"
    assert prefix_cache.main(["--quick", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["off"]["prefix_cache_hit_tokens"] == 0
    assert r["on"]["prefix_cache_hit_tokens"] >= 5 * 128  # every later request hit the prefix
    assert r["ttft_speedup"] > 0 and r["throughput_ratio"] > 0


def test_parallel_sampling_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    assert parallel_sampling.main(["--quick", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    fork, separate = r["n4_fork"], r["separate_no_caching"]
    assert fork["output_tokens"] == separate["output_tokens"] == 4 * 16
    # 160-token prompt (10 blocks) + 16 tokens: 4 x 11 blocks apart, 10 + 4 x 2 at most shared.
    assert separate["peak_used_blocks"] == 44
    assert fork["peak_used_blocks"] <= 18
    assert r["saving_vs_separate_pct"] > 55
