"""The simulator checked three ways.

reality  A real worker and control plane (SmolLM2, `--dtype auto`) serve W64 (64 requests at
         once, prompts 32..256, outputs 32..256, ignore_eos, a pool small enough to preempt)
         and a Poisson stream of the same lengths; each is simulated with the fitted `cpu`
         profile, the same pool and limits and the same requests at the same arrival times.
         Compared: output tokens/s, TTFT p50, steps and preemptions.
paper    OPT-13B on one A100-40GB, ShareGPT-like lengths, 2,048 positions: the request rate
         each allocation policy sustains under a normalized-latency threshold (the
         PagedAttention paper's Fig. 12), and how many requests each batches at once.
speed    10 simulated minutes of 100 requests/s of ShareGPT-like chat across 16 workers
         (Llama-3-8B on H100s, KV-aware routing): the wall time.

    python -m benchmarks.simulator_validation                      # all three
    python -m benchmarks.simulator_validation --checks reality --profile p.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.calibrate_simulator import read_trace, serve_requests, worker_info
from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    machine,
    model_dir,
    start_stack,
    write_json,
)

TOLERANCE = 0.15
PAPER_RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
PAPER_THRESHOLD_S_PER_TOKEN = 0.5


# -- reality --------------------------------------------------------------------------------------


def _counts(address: str) -> dict[str, int]:
    """The control plane's step and preemption counts so far."""
    import grpc

    from protos.v1 import control_plane_pb2 as pb
    from protos.v1 import control_plane_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        st = pb_grpc.ControlPlaneStub(ch).Stats(pb.StatsRequest(), timeout=30)
    return {
        "steps": sum(w.num_steps for w in st.workers),
        "preemptions": sum(w.num_preemptions for w in st.workers),
    }


def _real_summary(rows: list[dict[str, float]], output_lens: list[int]) -> dict[str, float]:
    span = max(r["end"] for r in rows) - min(r["sent"] for r in rows)
    return {
        "output_throughput": sum(output_lens) / span,
        "ttft_p50_ms": statistics.median(r["first"] - r["sent"] for r in rows) * 1e3,
    }


def _simulate(
    profile_path: Path,
    model: Path,
    dtype: str,
    worker: dict[str, Any],
    opts: StackOptions,
    prompts: list[list[int]],
    output_lens: list[int],
    arrivals: list[float],
    replay: list[float] | None = None,
) -> dict[str, Any]:
    """The run simulated with the fitted profile, or with `replay`: the real steps' times."""
    from simulator.cluster import Simulation
    from simulator.config import SimConfig
    from simulator.cost import CostModel, DeviceProfile, ReplayedCost
    from simulator.hardware import ModelShape
    from simulator.report import summarize
    from simulator.workload import SimRequest, Workload, WorkloadSpec

    profile = DeviceProfile.load(profile_path)
    shape = ModelShape.from_hf_config(model)
    shape = ModelShape(**{**vars(shape), "dtype_bytes": 4 if dtype == "float32" else 2})
    cost = CostModel(profile, shape, 1, worker["block_size"])
    if replay is not None:
        cost = ReplayedCost(cost, replay)
    cfg = SimConfig(
        num_workers=1,
        block_size=worker["block_size"],
        num_gpu_blocks=worker["num_gpu_blocks"],
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=worker["max_model_len"],
    )
    requests = [
        SimRequest(f"r{i}", a, p, n, ignore_eos=True)
        for i, (p, n, a) in enumerate(zip(prompts, output_lens, arrivals, strict=True))
    ]
    idle = Workload(WorkloadSpec(num_requests=0, max_model_len=worker["max_model_len"]))
    s = summarize(Simulation(cfg, cost, idle).run(requests))
    busy = s["worker_busy_frac"] * s["duration_s"]
    return {
        "output_throughput": s["output_throughput"],
        "ttft_p50_ms": s["ttft"]["p50_ms"],
        "steps": s["num_steps"],
        "preemptions": s["num_preemptions"],
        "empty_steps": s["num_empty_steps"],
        "mean_rows_per_step": s["mean_rows_per_step"],
        "mean_step_ms": busy / max(1, s["num_steps"] - s["num_empty_steps"]) * 1e3,
    }


def check_reality(profile: Path, quick: bool, kv_tokens: int = 8192) -> dict[str, Any]:
    model = model_dir("smollm2")
    # W64 holds up to 64 x 512 tokens at once: a pool of a quarter of that preempts.
    from gpu_worker.config import auto_dtype

    trace = RESULTS_DIR / "simulator_validation_steps.jsonl"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.unlink(missing_ok=True)
    opts = StackOptions(
        dtype=auto_dtype("cpu"), kv_tokens=kv_tokens, cp_args=("--step-trace", str(trace))
    )
    n = 16 if quick else 64
    rng = random.Random(0)
    plens = [rng.randint(32, 256) for _ in range(n)]
    olens = [rng.randint(32, 256) for _ in range(n)]
    runs: list[dict[str, Any]] = []
    with start_stack(model, opts) as stack:
        worker = worker_info(stack.worker_address)
        dtype, vocab = worker["dtype"], worker["vocab_size"]
        asyncio.run(serve_requests(stack.address, [[5] * 8], [2], [0.0]))  # warm
        w64_rate = None
        for name in ("W64", "poisson"):
            prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p in plens]
            if name == "W64":
                arrivals = [0.0] * n
            else:
                # Half the W64 request throughput: busy, mostly without a queue.
                assert w64_rate is not None
                t, arrivals = 0.0, []
                for _ in range(n):
                    arrivals.append(t)
                    t += rng.expovariate(w64_rate / 2)
            before = _counts(stack.address)
            done = len(read_trace(trace))
            ids = [f"{name}-{i}" for i in range(n)]
            rows = asyncio.run(serve_requests(stack.address, prompts, olens, arrivals, ids))
            after = _counts(stack.address)
            real = {**_real_summary(rows, olens), **{k: after[k] - before[k] for k in after}}
            steps = read_trace(trace)[done:]
            with_tokens = [s for s in steps if s["tokens"]]
            real["empty_steps"] = len(steps) - len(with_tokens)
            real["mean_rows_per_step"] = statistics.fmean(s["rows"] for s in with_tokens)
            real["mean_step_ms"] = statistics.fmean(s["seconds"] for s in with_tokens) * 1e3
            if name == "W64":
                span = max(r["end"] for r in rows)
                w64_rate = n / span
            sim = _simulate(profile, model, dtype, worker, opts, prompts, olens, arrivals)
            # The same run again with the real steps' times, the requests' real send times
            # and the order the control plane took them in (requests sent at once arrive in
            # any order): what is left is the scheduling, the same code on both sides.
            order = list(dict.fromkeys(ids.index(r) for s in steps for r in s["new"]))
            start = min(r["t0"] + r["sent"] for r in rows)
            sent = sorted(r["t0"] + r["sent"] - start for r in rows)
            replayed = _simulate(
                profile,
                model,
                dtype,
                worker,
                opts,
                [prompts[i] for i in order],
                [olens[i] for i in order],
                sent,
                replay=[s["seconds"] for s in steps],
            )
            ratios = {
                k: sim[k] / real[k] if real[k] else (1.0 if sim[k] == 0 else math.inf)
                for k in ("output_throughput", "ttft_p50_ms")
            }
            runs.append(
                {
                    "workload": name,
                    "real": real,
                    "simulated": sim,
                    "ratios": ratios,
                    "replayed": replayed,
                }
            )
            print(
                f"  {name}: rows per step real {real['mean_rows_per_step']:.1f} / simulated "
                f"{sim['mean_rows_per_step']:.1f}; step {real['mean_step_ms']:.1f} / "
                f"{sim['mean_step_ms']:.1f} ms; steps without tokens {real['empty_steps']} / "
                f"{sim['empty_steps']}"
            )
            print(
                f"  {name}: real {real['output_throughput']:.0f} tok/s, TTFT p50 "
                f"{real['ttft_p50_ms']:.0f} ms, {real['steps']} steps, "
                f"{real['preemptions']} preemptions; simulated {sim['output_throughput']:.0f}, "
                f"{sim['ttft_p50_ms']:.0f} ms, {sim['steps']}, {sim['preemptions']}",
                flush=True,
            )
            print(
                f"  {name}: with the real step times, simulated {replayed['steps']} steps, "
                f"{replayed['preemptions']} preemptions",
                flush=True,
            )
    return {"model": "smollm2", "dtype": dtype, "worker": worker, "runs": runs}


# -- paper ----------------------------------------------------------------------------------------


def check_paper(quick: bool) -> dict[str, Any]:
    from simulator.cli import build_args, run_sweep

    rates = PAPER_RATES[::3] if quick else PAPER_RATES
    args = build_args(
        [
            "--device", "A100-40GB", "--model", "opt-13b", "--workload", "sharegpt",
            "--allocation", "paged,orca-oracle,orca-pow2,orca-max",
            "--max-num-batched-tokens", "2048", "--max-num-seqs", "256",
            "--rate", ",".join(str(r) for r in rates),
            "--duration", "120" if quick else "900",
            "--latency-threshold", str(PAPER_THRESHOLD_S_PER_TOKEN),
        ]
    )  # fmt: skip
    report = run_sweep(args)
    sustained = report["sustained_rates"]
    paged = sustained.get("paged / kv-aware")
    out: dict[str, Any] = {"sustained_rates": sustained, "threshold": PAPER_THRESHOLD_S_PER_TOKEN}
    for base in ("orca-oracle", "orca-pow2", "orca-max"):
        other = sustained.get(f"{base} / kv-aware")
        out[f"paged_vs_{base}_rate"] = paged / other if paged and other else None
    top = max(float(r["rate"]) for r in report["runs"])
    batch = {
        r["allocation"]: r["summary"]["mean_batch_size"]
        for r in report["runs"]
        if float(r["rate"]) == top
    }
    out["mean_batch_at_top_rate"] = batch
    out["top_rate"] = top
    for base in ("orca-oracle", "orca-pow2", "orca-max"):
        out[f"paged_vs_{base}_batch"] = batch["paged"] / batch[base] if batch.get(base) else None
    out["curves"] = {
        f"{r['allocation']}@{r['rate']}": r["summary"]["normalized_latency_s_per_token"]
        for r in report["runs"]
    }
    out["num_gpu_blocks"] = report["runs"][0]["summary"]["num_gpu_blocks_per_worker"]
    return out


# -- speed ----------------------------------------------------------------------------------------


def check_speed(quick: bool) -> dict[str, Any]:
    from simulator.cli import build_args, run_sweep

    duration = 60 if quick else 600
    args = build_args(
        [
            "--device", "H100", "--model", "llama-3-8b", "--workers", "16",
            "--rate", "100", "--duration", str(duration), "--workload", "sharegpt",
            "--max-num-batched-tokens", "8192", "--max-model-len", "4096",
        ]
    )  # fmt: skip
    t0 = time.perf_counter()
    report = run_sweep(args)
    wall = time.perf_counter() - t0
    s = report["runs"][0]["summary"]
    return {
        "simulated_s": duration,
        "wall_s": wall,
        "completed": s["completed"],
        "steps": s["num_steps"],
        "control_plane_cpu_per_step_us": s["control_plane"]["cpu_per_step_us"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checks", default="reality,paper,speed")
    p.add_argument(
        "--profile",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "simulator" / "profiles" / "cpu.json",
        help="the fitted cpu profile (python -m benchmarks.calibrate_simulator)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=8192,
        help="the real worker's KV pool in tokens (8192: W64 preempts)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "simulator_validation.json")
    a = p.parse_args(argv)
    checks = {c.strip() for c in a.checks.split(",") if c.strip()}
    report: dict[str, Any] = {"benchmark": "simulator_validation", "machine": machine()}
    if "reality" in checks:
        print("reality: SmolLM2 on this machine against its simulation")
        r = check_reality(a.profile, a.quick, a.kv_tokens)
        report["reality"] = r
        rows = [
            [
                run["workload"],
                f"{run['real']['output_throughput']:.0f}",
                f"{run['simulated']['output_throughput']:.0f}",
                f"{run['ratios']['output_throughput']:.2f}",
                f"{run['real']['ttft_p50_ms']:.0f}",
                f"{run['simulated']['ttft_p50_ms']:.0f}",
                f"{run['ratios']['ttft_p50_ms']:.2f}",
                f"{run['real']['steps']} / {run['simulated']['steps']}",
                f"{run['real']['preemptions']} / {run['simulated']['preemptions']}",
                f"{run['replayed']['steps']} / {run['replayed']['preemptions']}",
            ]
            for run in r["runs"]
        ]
        headers = [
            "workload", "real tok/s", "sim tok/s", "ratio", "real TTFT p50", "sim TTFT p50",
            "ratio", "steps real/sim", "preemptions real/sim",
            "replayed step times: steps / preemptions",
        ]  # fmt: skip
        print(format_table(headers, rows))
        ok = all(abs(v - 1) <= TOLERANCE for run in r["runs"] for v in run["ratios"].values())
        print(f"within {TOLERANCE:.0%}: {ok}")
        r["within_tolerance"] = ok
    if "paper" in checks:
        print("paper: OPT-13B on an A100-40GB, ShareGPT-like lengths")
        r = check_paper(a.quick)
        report["paper"] = r
        print(f"  KV blocks: {r['num_gpu_blocks']}; sustained rates: {r['sustained_rates']}")
        for base in ("orca-oracle", "orca-pow2", "orca-max"):
            print(
                f"  paged vs {base}: rate {r[f'paged_vs_{base}_rate']}, "
                f"batch {r[f'paged_vs_{base}_batch']}"
            )
    if "speed" in checks:
        print("speed: 100 requests/s across 16 workers")
        r = check_speed(a.quick)
        report["speed"] = r
        print(
            f"  {r['simulated_s']} simulated s in {r['wall_s']:.0f} s of wall time "
            f"({r['completed']} requests, {r['steps']} steps)"
        )
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
