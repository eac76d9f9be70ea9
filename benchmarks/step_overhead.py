"""The control plane's cost per iteration beside the worker's model time, at batch 1..256.

A real worker process runs the model; this process runs the control plane's own engine pieces
(`EngineLoop`'s scheduler, block manager and publishing, over one `Worker.Execute` stream) and
times each part of `EngineLoop.step` for steady decode steps at a fixed batch size:

    schedule     Scheduler.schedule()
    encode       StepPlan -> protobuf (pagedserve.wire)
    round trip   write the plan, read the result (includes the worker's whole step)
    decode       protobuf -> StepResult
    update       Scheduler.update()
    publish      detokenize, stop strings, one chunk per request into its stream's queue

The worker reports `model_time_s` (batch building, forward, sampling) and `total_time_s`
(everything it did for the step), so: transport = round trip - worker total; control plane =
schedule + encode + decode + update + publish; overhead = step - model time.

    python -m benchmarks.step_overhead --preset small
    python -m benchmarks.step_overhead --quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    machine,
    model_dir,
    start_worker,
    write_json,
)

PARTS = ("schedule", "encode", "round_trip", "decode", "update", "publish")


async def _measure(
    worker_address: str,
    model: Path,
    batches: Sequence[int],
    prompt_len: int,
    steps: int,
    scheduler_limits: tuple[int, int],
) -> list[dict[str, Any]]:
    import random

    from control_plane.engine import EngineLoop
    from control_plane.request import Request
    from control_plane.scheduler import SchedulerConfig
    from control_plane.tokenizer import load_tokenizer
    from control_plane.worker_client import WorkerClient
    from pagedserve import wire
    from pagedserve.sampling_params import SamplingParams

    client = WorkerClient(worker_address)
    info = await client.describe(timeout=60)
    cfg = SchedulerConfig(
        max_num_seqs=scheduler_limits[0],
        max_num_batched_tokens=scheduler_limits[1],
        max_model_len=info.max_model_len,
        eos_token_ids=tuple(info.eos_token_ids),
    )
    loop = EngineLoop(client, info, cfg, load_tokenizer(model))
    call = client.stub.Execute()
    rng = random.Random(0)
    step_id = 0
    rows: list[dict[str, Any]] = []
    try:
        for batch in batches:
            # Long enough that the last request's prefill ends before the first one finishes.
            max_tokens = steps + 4 + -(-batch * prompt_len // scheduler_limits[1])
            for i in range(batch):
                prompt = [rng.randrange(3, info.vocab_size) for _ in range(prompt_len)]
                sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                loop.add_request(Request(f"b{batch}-{i}", prompt, sp, arrival_time=time.time()))
            samples: dict[str, list[float]] = {k: [] for k in (*PARTS, "model", "worker", "step")}
            while loop.scheduler.has_unfinished_requests():
                t0 = time.perf_counter()
                plan = loop.scheduler.schedule()
                t1 = time.perf_counter()
                step_id += 1
                plan.step_id = step_id
                msg = wire.plan_to_proto(plan)
                t2 = time.perf_counter()
                await call.write(msg)
                reply = await call.read()
                t3 = time.perf_counter()
                result = wire.result_from_proto(reply)
                t4 = time.perf_counter()
                deltas = loop.scheduler.update(plan, result)
                t5 = time.perf_counter()
                loop._publish(deltas)
                t6 = time.perf_counter()
                for stream in list(loop.streams.values()):
                    while not stream.queue.empty():
                        stream.queue.get_nowait()
                if len(samples["step"]) >= steps:
                    for req_id in list(loop.streams):
                        loop.abort(req_id)
                    continue
                steady = len(plan.num_scheduled_tokens) == batch == plan.total_num_scheduled_tokens
                if not steady:
                    continue
                for key, v in zip(
                    PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True
                ):
                    samples[key].append(v)
                samples["model"].append(result.model_time_s)
                samples["worker"].append(result.total_time_s)
                samples["step"].append(t6 - t0)
            loop.streams.clear()
            rows.append(_row(batch, samples))
            print(
                f"  batch {batch}: step {rows[-1]['step_ms']:.2f} ms, "
                f"control plane {rows[-1]['control_plane_frac'] * 100:.1f}%",
                flush=True,
            )
    finally:
        call.cancel()
        await client.close()
    return rows


def _row(batch: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    med = {k: statistics.median(v) * 1e3 if v else 0.0 for k, v in samples.items()}
    cp = sum(med[k] for k in PARTS if k != "round_trip")
    step = med["step"]
    return {
        "batch": batch,
        "num_steps": len(samples["step"]),
        **{f"{k}_ms": med[k] for k in PARTS},
        "worker_total_ms": med["worker"],
        "model_ms": med["model"],
        "transport_ms": med["round_trip"] - med["worker"],
        "control_plane_ms": cp,
        "step_ms": step,
        "control_plane_frac": cp / step if step else 0.0,
        "overhead_frac": (step - med["model"]) / step if step else 0.0,
    }


def print_report(rep: dict[str, Any]) -> None:
    print(
        f"\nper-step cost, decode at a fixed batch ({rep['preset']}, "
        f"prompt {rep['prompt_len']}), medians in ms"
    )
    headers = [
        "batch",
        "schedule",
        "encode",
        "rtt",
        "decode",
        "update",
        "publish",
        "transport",
        "worker",
        "model",
        "step",
        "cp %",
        "not model %",
    ]
    rows = [
        [
            r["batch"],
            r["schedule_ms"],
            r["encode_ms"],
            r["round_trip_ms"],
            r["decode_ms"],
            r["update_ms"],
            r["publish_ms"],
            r["transport_ms"],
            r["worker_total_ms"],
            r["model_ms"],
            r["step_ms"],
            r["control_plane_frac"] * 100,
            r["overhead_frac"] * 100,
        ]
        for r in rep["rows"]
    ]
    print(format_table(headers, rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--worker-threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny model, batches 1,4,8, 4 steps")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    preset = "tiny" if a.quick else a.preset
    batches = [1, 4, 8] if a.quick else [int(b) for b in a.batches.split(",")]
    steps = 4 if a.quick else a.steps
    prompt_len = 16 if a.quick else a.prompt_len
    model = a.model or model_dir(preset)
    max_seqs = max(batches)
    max_tokens = steps + 8 + -(-max_seqs * prompt_len // 2048)
    kv_tokens = max_seqs * (prompt_len + max_tokens) + 1024
    opts = StackOptions(kv_tokens=kv_tokens, worker_threads=a.worker_threads, max_num_seqs=max_seqs)
    with start_worker(model, opts) as worker:
        rows = asyncio.run(
            _measure(worker.worker_address, model, batches, prompt_len, steps, (max_seqs, 2048))
        )
    rep = {
        "benchmark": "step_overhead",
        "mode": "quick" if a.quick else "full",
        "preset": preset,
        "prompt_len": prompt_len,
        "machine": machine(),
        "rows": rows,
    }
    print_report(rep)
    out = a.out or RESULTS_DIR / f"step_overhead_{preset}.json"
    write_json(out, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
