"""The CPU team's benchmark runs and reports both teams, alone and with noise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import cpu_team

# Threads bound to cores, busy processes beside them: alone, after the busy phase.
pytestmark = pytest.mark.serial


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no team of two")
def test_quick_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "cpu_team.json"
    assert cpu_team.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["threads"] == 2 and report["noise_processes"] == 1
    assert [r["shape"] for r in report["rows"]] == [
        "tiny qkv",
        "tiny gate_up",
        "tiny down",
        "tiny head",
    ]
    for row in report["rows"]:
        for key in ("onednn", "team", "onednn noisy", "team noisy"):
            assert row[key]["mean_us"] > 0 and row[key]["gflops"] > 0
