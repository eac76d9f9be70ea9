"""The CPU team's products beside oneDNN's on an OpenMP team, alone and with other processes
taking slices of the cores, as the gateway, the control plane and their clients do.

Each configuration runs in a child process of its own (the team, like OpenMP's, is one per
process), bound as a worker binds its threads, one to a core:

    onednn   torch's prepacked oneDNN product (`torch.ops.mkldnn`) on an OpenMP team of N
    team     `gpu_worker.cpu_team` with N - 1 helpers
    team-amx the same with its bf16 products on AMX tiles (where the CPU has AMX)

and times each shape's product (the projections of a 64-row decode step of `tiny` in
float32 and of `small` in bf16, and a 512-row prompt chunk) `--reps` times, alone and while
`--noise` busy processes each run 1 ms of every 4 ms on the same cores. What a noisy product
costs shows what a step loses to the edge: an OpenMP team waits at each barrier for a thread
that lost its core, the team takes such a thread's items back.

    python -m benchmarks.cpu_team [--threads 2] [--reps 200] [--noise 2] [--out PATH]
    python -m benchmarks.cpu_team --quick      # the smoke run `make test` does

bf16 rows are skipped where the CPU has neither AVX512-BF16 nor AMX. A table goes to stdout,
every figure to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, format_table, machine, write_json

# (name, dtype, rows, in, out): the projections of one layer and the LM head.
SHAPES = [
    ("tiny qkv", "float32", 64, 256, 512),
    ("tiny gate_up", "float32", 64, 256, 1376),
    ("tiny down", "float32", 64, 688, 256),
    ("tiny head", "float32", 64, 256, 4096),
    ("tiny gate_up, 512 rows", "float32", 512, 256, 1376),
    ("small qkv", "bfloat16", 64, 768, 1280),
    ("small gate_up", "bfloat16", 64, 768, 4096),
    ("small down", "bfloat16", 64, 2048, 768),
    ("small head", "bfloat16", 64, 768, 32000),
    ("small gate_up, 512 rows", "bfloat16", 512, 768, 4096),
]

CHILD = """
import json, os, sys, time, torch
mode, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shapes, cpus = json.loads(sys.argv[4]), json.loads(sys.argv[5])
os.sched_setaffinity(0, {cpus[0]})
if mode.startswith("team"):
    from gpu_worker import cpu_team
    torch.set_num_threads(1)
    team = cpu_team.start(cpus[1:])
    assert team is not None and team.width == threads
    if mode == "team-amx":
        assert cpu_team.set_tiles("amx") == "amx"
else:
    torch.set_num_threads(threads)
out = {}
for name, dtype, m, k, n in shapes:
    dt = getattr(torch, dtype)
    w, x = torch.randn(n, k).to(dt), torch.randn(m, k).to(dt)
    if mode.startswith("team"):
        p = team.pack(w, dt)
        run = lambda: team.linear(x, p, n, None)
    else:
        p = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        run = lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    for _ in range(10):
        run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    out[name] = times
print(json.dumps(out))
"""

NOISE = """
import time, sys
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.001:
        pass
    time.sleep(0.003)
"""


def _run(mode: str, threads: int, reps: int, shapes: list[tuple[Any, ...]], noise: int) -> dict:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {**os.environ, "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    env.pop("OMP_NUM_THREADS", None)
    noisy = [
        subprocess.Popen(
            [sys.executable, "-c", NOISE, "600"],
            preexec_fn=lambda: os.sched_setaffinity(0, set(cpus)),
        )
        for _ in range(noise)
    ]
    try:
        out = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", CHILD, mode, str(threads), str(reps)]
            + [json.dumps(shapes)]
            + [json.dumps(cpus)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{mode}: exit code {out.returncode}: {out.stderr[-3000:]}")
    finally:
        for p in noisy:
            p.kill()
            p.wait()
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--noise", type=int, default=2, help="busy processes in the noisy runs")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "cpu_team.json")
    p.add_argument("--quick", action="store_true", help="tiny's products, 5 reps, 1 noise process")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.noise = 5, 1

    from gpu_worker import cpu_isa
    from gpu_worker.cpu_team import MAX_THREADS

    if len(os.sched_getaffinity(0)) < a.threads or not 2 <= a.threads <= MAX_THREADS:
        print(f"needs {a.threads} cores and 2 <= --threads <= {MAX_THREADS}")
        return 2
    amx = cpu_isa.bf16_isa() == "amx_bf16"
    shapes = [s for s in SHAPES if s[1] == "float32" or cpu_isa.bf16_isa() == "avx512_bf16" or amx]
    if a.quick:
        shapes = [s for s in shapes if s[0].startswith("tiny") and s[2] == 64]
    results: dict[str, dict[str, list[float]]] = {}
    for noise in (0, a.noise):
        for mode in ("onednn", "team", "team-amx") if amx else ("onednn", "team"):
            key = f"{mode}{' noisy' if noise else ''}"
            print(f"running {key} ...", flush=True)
            results[key] = _run(mode, a.threads, a.reps, shapes, noise)

    rows, table = [], []
    for name, dtype, m, k, n in shapes:
        flop = 2 * m * k * n
        row: dict[str, Any] = {"shape": name, "dtype": dtype, "rows": m, "in": k, "out": n}
        cells = [name, dtype]
        for key, runs in results.items():
            # The mean: a product that waited out a slice counts in full (a median hides it).
            mean = statistics.fmean(runs[name])
            p99 = sorted(runs[name])[int(0.99 * (len(runs[name]) - 1))]
            row[key] = {"mean_us": mean * 1e6, "p99_us": p99 * 1e6, "gflops": flop / mean / 1e9}
            cells.append(f"{mean * 1e6:,.0f} us ({flop / mean / 1e9:.0f})")
        rows.append(row)
        table.append(cells)
    headers = ["product", "dtype", *(f"{k}: mean (GFLOP/s)" for k in results)]
    print(format_table(headers, table))
    report = {
        "benchmark": "cpu_team",
        "threads": a.threads,
        "noise_processes": a.noise,
        "reps": a.reps,
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
