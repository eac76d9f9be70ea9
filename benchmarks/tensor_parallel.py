"""Tensor parallelism's cost on this machine: W64 offline through the whole stack with the
worker on one rank (all threads) and split over N ranks (the threads shared among them), and
the time of one all-reduce of a W64 decode step's activation (64 x hidden) between N ranks.

On a CPU box the ranks share the same cores and memory bandwidth, so a split cannot be faster:
the figures measure what the collectives and the extra processes cost. On a machine with N
devices the same script measures the speed-up (`--device cuda`).

    python -m benchmarks.tensor_parallel --preset small [--sizes 1,2] [--threads 2] [--out PATH]
    python -m benchmarks.tensor_parallel --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    free_port,
    machine,
    model_dir,
    quick_workload,
    random_workload,
    write_json,
)
from benchmarks.offline_throughput import run_pagedserve
from gpu_worker.checkpoint import load_config

ALL_REDUCE_ROWS = 64
ALL_REDUCE_REPEATS = 200


def _all_reduce_rank(rank: int, size: int, port: int, hidden: int, dtype: str, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    t = torch.ones(ALL_REDUCE_ROWS, hidden, dtype=getattr(torch, dtype))
    for _ in range(20):
        dist.all_reduce(t)
    times = []
    for _ in range(ALL_REDUCE_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def all_reduce_us(size: int, hidden: int, dtype: str) -> dict[str, float]:
    """Median and p90 microseconds of one all-reduce of [64, hidden] over `size` ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_all_reduce_rank, args=(r, size, port, hidden, dtype, queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    times = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    times.sort()
    return {
        "median_us": statistics.median(times) * 1e6,
        "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to run")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="worker threads")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 short requests")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "tensor_parallel.json")
    a = ap.parse_args(argv)
    preset = "tiny" if a.quick else a.preset
    model = model_dir(preset)
    config = load_config(model)
    wl = quick_workload(config.vocab_size) if a.quick else random_workload(config.vocab_size)
    sizes = [int(s) for s in a.sizes.split(",")]
    runs = []
    for size in sizes:
        opts = StackOptions(
            dtype=a.dtype,
            worker_threads=a.threads,
            worker_args=("--tensor-parallel-size", str(size)),
        )
        run = run_pagedserve(model, wl, opts)
        runs.append(
            {
                "tensor_parallel_size": size,
                "threads_per_rank": max(1, a.threads // size),
                "output_tokens_per_s": run.tok_per_s,
                "elapsed_s": run.elapsed_s,
                "outputs": run.outputs,
            }
        )
    same = [r["outputs"] == runs[0]["outputs"] for r in runs]
    reduce = {
        str(size): all_reduce_us(size, config.hidden_size, a.dtype) for size in sizes if size > 1
    }
    rows = [
        [
            r["tensor_parallel_size"],
            r["threads_per_rank"],
            f"{r['output_tokens_per_s']:.0f}",
            f"{r['output_tokens_per_s'] / runs[0]['output_tokens_per_s']:.2f}x",
            "yes" if s else "no",
        ]
        for r, s in zip(runs, same, strict=True)
    ]
    print(f"W64 offline, {preset}, {a.dtype}, {a.threads} threads")
    print(format_table(["TP", "threads/rank", "tok/s", "vs TP=1", "same tokens"], rows))
    for ranks, timing in reduce.items():
        print(
            f"all-reduce of [{ALL_REDUCE_ROWS}, {config.hidden_size}] {a.dtype} over {ranks} ranks "
            f"(gloo): median {timing['median_us']:.0f} us, p90 {timing['p90_us']:.0f} us"
        )
    report = {
        "benchmark": "tensor_parallel",
        "machine": machine(),
        "model": preset,
        "dtype": a.dtype,
        "workload": wl.describe(),
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "same_tokens_as_tp1": same,
        "all_reduce": {"rows": ALL_REDUCE_ROWS, "hidden": config.hidden_size, "by_size": reduce},
    }
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
