"""The kernel benchmark's smoke configuration runs (under the Triton interpreter on the CPU) and
writes a report with every figure the GPU run records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import kernels as bench


def test_quick_benchmark_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nested" / "kernels.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0

    report = json.loads(out.read_text())
    assert report["mode"] == "quick"
    assert report["layout"] == {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    assert report["dtype"] == "bfloat16"
    assert report["decode"] and report["prefill"]
    for row in report["decode"]:
        assert row["kv_bytes"] == 2 * row["batch"] * row["context"] * 8 * 128 * 2
        for key in ("one_pass", "split_k", "triton", "sdpa"):
            assert row[f"{key}_ms"] > 0 and row[f"{key}_gbps"] > 0
            assert row[f"{key}_peak_frac"] is None  # no known peak for a CPU
    for row in report["prefill"]:
        assert row["triton_ms"] > 0 and row["sdpa_ms"] > 0 and row["triton_tflops"] > 0
    assert "decode (bfloat16" in capsys.readouterr().out


def test_peak_bandwidth_and_fractions() -> None:
    assert bench.peak_gbps(torch.device("cpu"), None) is None
    assert bench.peak_gbps(torch.device("cpu"), 100.0) == 100.0
    row: dict[str, object] = {}
    bench.rates(row, "triton", ms=2.0, nbytes=10**9, peak=1000.0)
    assert row == {"triton_ms": 2.0, "triton_gbps": 500.0, "triton_peak_frac": 0.5}
