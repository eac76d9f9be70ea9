"""serve_compare (`up` servers through HTTP, one with a variant's environment) end to end on
`tiny`, and bf16_targets reading its rates from both benchmarks' real reports."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import bf16_targets, offline_throughput, serve_compare


# Two `up` stacks with vLLM's KV budget each (4 GiB). At a load of 30 they served 2 tokens a
# second, 500 tokens each: the timeout only bounds a hang.
@pytest.mark.serial
@pytest.mark.timeout(1800)
def test_serve_compare_with_a_variant(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    variant = "PAGEDSERVE_CPU_TEAM=0 --num-threads 1"
    argv = ["--preset", "tiny", "--num-prompts", "4", "--rounds", "1", "--warmup-rounds", "0"]
    argv += ["--vllm-venv", str(tmp_path / "no-venv"), "--pagedserve-variant", variant]
    assert serve_compare.main([*argv, "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = {r["system"]: r for r in rep["systems"]}
    assert set(rows) == {"pagedserve@inf", f"pagedserve {variant}@inf"}  # no vLLM here
    for row in rows.values():
        assert row["failed"] == 0 and row["output_tok_per_s"] > 0
        assert row["output_tokens_runs"] == [rows["pagedserve@inf"]["output_tokens_runs"][0]]
    assert bf16_targets._rate(rep, "pagedserve") == rows["pagedserve@inf"]["output_tok_per_s"]
    assert bf16_targets._rate(rep, f"pagedserve {variant}") > 0
    assert bf16_targets._rate(rep, "vllm") is None


def test_bf16_targets_reads_offline_reports(
    tmp_path: Path, make_checkpoint: Callable[..., Path]
) -> None:
    out = tmp_path / "offline.json"
    model = make_checkpoint("llama", preset="tiny")
    argv = ["--quick", "--model", str(model), "--systems", "pagedserve,hf-static"]
    assert offline_throughput.main([*argv, "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    ours = next(r for r in rep["systems"] if r["system"].startswith("pagedserve"))
    assert bf16_targets._rate(rep, "pagedserve") == ours["output_tok_per_s"] > 0
    assert bf16_targets._rate(rep, "vllm") is None


def test_bf16_targets_refuses_what_it_cannot_run() -> None:
    with pytest.raises(SystemExit):  # a variant is environment variables only
        bf16_targets.main(["--vllm-venv", "x", "--variant", "--num-threads 1"])
    with pytest.raises(SystemExit):  # float32 rows only with --float32
        bf16_targets.main(["--vllm-venv", "x", "--only", "tiny streamed float32"])
    with pytest.raises(SystemExit):  # a name it does not know
        bf16_targets.main(["--vllm-venv", "x", "--float32", "--only", "tiny streamed, float32"])
