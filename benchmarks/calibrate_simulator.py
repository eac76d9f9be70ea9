"""Fits the simulator's `cpu` device profile to our worker's measured step times.

A real worker and control plane serve a sweep of batch shapes as a client would send them
(streaming Generate calls over gRPC, from this process): decode batches of 1..128 requests at
short and long contexts, single prefills of 32..4,096 tokens (chunked at the token budget),
and requests of mixed lengths, all at once and arriving one by one, one group after another.
The control plane writes every step's shape and timing (`--step-trace`: the shape is what the
simulator computes for the same plan, the time runs from the later of the plan's send and the
previous result to its result), so the steps are measured as they run in service, with the
control plane and the client on the same cores.
`simulator.calibrate.fit_profile` then fits the cost model's constants, and the profile is
written as JSON.

    python -m benchmarks.calibrate_simulator                # SmolLM2, --dtype auto
    python -m benchmarks.calibrate_simulator --preset tiny --dtype float32 --out p.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    machine,
    model_dir,
    start_stack,
    write_json,
)

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (64, 512)
PREFILLS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_DECODE_BATCHES = (1, 8, 32)
QUICK_DECODE_CONTEXTS = (64,)
QUICK_PREFILLS = (128, 512)


def worker_info(address: str) -> dict[str, Any]:
    import grpc

    from protos.v1 import worker_pb2
    from protos.v1 import worker_pb2_grpc as w_grpc

    with grpc.insecure_channel(address) as ch:
        info = w_grpc.WorkerStub(ch).Describe(worker_pb2.DescribeRequest(), timeout=30)
    return {
        "num_gpu_blocks": info.num_gpu_blocks,
        "block_size": info.block_size,
        "dtype": info.dtype,
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
    }


# Requests, prompt and output length ranges (lo, hi), and arrivals per second (inf: at once).
Group = tuple[int, tuple[int, int], tuple[int, int], float]
# Served as they come: mixed lengths all at once, as a benchmark's requests (prefills of many
# short prompts packed into one step, then decode), and the same arriving one by one (small
# batches, a prefill now and then, the control plane busy with arrivals).
MIXED: list[Group] = [(64, (32, 256), (8, 64), math.inf), (48, (32, 256), (32, 128), 1.0)]


def sweep(quick: bool, decode_steps: int) -> list[Group]:
    """Groups of requests, run one after another."""
    batches = QUICK_DECODE_BATCHES if quick else DECODE_BATCHES
    contexts = QUICK_DECODE_CONTEXTS if quick else DECODE_CONTEXTS
    prefills = QUICK_PREFILLS if quick else PREFILLS
    groups: list[Group] = [
        (b, (c, c), (decode_steps, decode_steps), math.inf) for c in contexts for b in batches
    ]
    groups += [(1, (p, p), (2, 2), math.inf) for p in prefills]
    return groups if quick else groups + MIXED


async def serve_requests(
    address: str,
    prompts: list[list[int]],
    output_lens: list[int],
    arrivals: list[float],
    ids: list[str] | None = None,
) -> list[dict[str, float]]:
    """Sends each request at its arrival time (seconds from now) as a streaming Generate with
    ignore_eos; per request its send time, first-token time and end (seconds from the
    start), and the start itself (`t0`, perf_counter seconds: the clock of `--step-trace`)."""
    import grpc

    from protos.v1 import common_pb2
    from protos.v1 import control_plane_pb2 as pb
    from protos.v1 import control_plane_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)

        async def one(
            prompt: list[int], n: int, at: float, t0: float, req_id: str
        ) -> dict[str, float]:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            req = pb.GenerateRequest(
                request_id=req_id,
                sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            )
            req.token_ids.ids.extend(prompt)
            sent = time.perf_counter() - t0
            first = None
            tokens = 0
            async for msg in stub.Generate(req, timeout=3600):
                if msg.token_ids and first is None:
                    first = time.perf_counter() - t0
                tokens += len(msg.token_ids)
            if tokens != n:
                raise RuntimeError(f"asked for {n} tokens, got {tokens}")
            end = time.perf_counter() - t0
            return {"sent": sent, "first": first or 0.0, "end": end, "t0": t0}

        t0 = time.perf_counter()
        return list(
            await asyncio.gather(
                *(
                    one(p, n, a, t0, i)
                    for p, n, a, i in zip(
                        prompts, output_lens, arrivals, ids or [""] * len(prompts), strict=True
                    )
                )
            )
        )


def read_trace(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measure(
    address: str, vocab_size: int, groups: Sequence[Group], trace: Path
) -> list[dict[str, Any]]:
    """Serves each group whole, one after another; every step of the trace, labelled with its
    group."""
    rng = random.Random(0)
    samples: list[dict[str, Any]] = []
    warm = [[rng.randrange(3, vocab_size) for _ in range(8)]]
    asyncio.run(serve_requests(address, warm, [2], [0.0]))
    for gi, (batch, prompt_lens, out_lens, rate) in enumerate(groups):
        done = len(read_trace(trace))
        prompts = [
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_lens))]
            for _ in range(batch)
        ]
        outs = [rng.randint(*out_lens) for _ in range(batch)]
        arrivals = [0.0] * batch
        if math.isfinite(rate):
            for i in range(1, batch):
                arrivals[i] = arrivals[i - 1] + rng.expovariate(rate)
        asyncio.run(serve_requests(address, prompts, outs, arrivals))
        steps = read_trace(trace)[done:]
        samples += [{"group": gi, **s} for s in steps]
        print(f"  group {gi}: {batch} x prompt {prompt_lens}: {len(steps)} steps", flush=True)
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=["smollm2", "tiny", "small"], default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-tokens", type=int, default=1 << 17)
    p.add_argument("--quick", action="store_true", help="a small sweep (tests)")
    p.add_argument(
        "--refit", type=Path, default=None, help="fit again the samples of an earlier --out"
    )
    p.add_argument(
        "--profile-out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "simulator" / "profiles" / "cpu.json",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "calibrate_simulator.json")
    a = p.parse_args(argv)

    from gpu_worker.config import auto_dtype
    from pagedserve.plan import StepShape
    from simulator.calibrate import fit_profile
    from simulator.hardware import ModelShape

    m = machine()
    if a.refit is not None:
        earlier = json.loads(a.refit.read_text())
        a.preset, samples, info = earlier["preset"], earlier["samples"], earlier["worker"]
        m = earlier["machine"]
        model = model_dir(a.preset)
    else:
        model = model_dir(a.preset)
        dtype = auto_dtype("cpu") if a.dtype == "auto" else a.dtype
        groups = sweep(a.quick, a.decode_steps)
        with tempfile.TemporaryDirectory() as d:
            trace = Path(d) / "steps.jsonl"
            opts = StackOptions(
                dtype=dtype,
                kv_tokens=a.kv_tokens,
                max_num_batched_tokens=a.max_num_batched_tokens,
                cp_args=("--step-trace", str(trace)),
            )
            with start_stack(model, opts) as stack:
                info = worker_info(stack.worker_address)
                samples = measure(stack.address, info["vocab_size"], groups, trace)
    dtype_bytes = 4 if info["dtype"] == "float32" else 8 if info["dtype"] == "float64" else 2
    shape = ModelShape.from_hf_config(model, name=a.preset)
    shape = ModelShape(**{**vars(shape), "dtype_bytes": dtype_bytes})
    keys = [f for f in StepShape.__dataclass_fields__]
    # A step the control plane saw end sooner after the previous result than the worker took
    # to compute it was sent while that result was on its way: it began before the previous
    # result arrived, and the worker's own time is the better measure of it.
    fit_on = [
        (StepShape(**{k: s[k] for k in keys}), max(s["seconds"], s["worker_seconds"]))
        for s in samples
    ]
    profile, err = fit_profile(
        "cpu",
        shape,
        fit_on,
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        info["block_size"],
        groups=[s["group"] for s in samples],
    )
    profile = type(profile)(
        **{
            **vars(profile),
            "fitted": {
                "model": a.preset,
                "model_shape": vars(shape),
                "dtype": info["dtype"],
                "cpu": m["cpu"],
                "isa": m["isa"],
                "cores": m["cores"],
                "date": m["date"],
                "steps": len(fit_on),
                "median_relative_error": err,
            },
        }
    )
    profile.save(a.profile_out)
    print(
        f"fitted {len(fit_on)} steps ({a.preset}, {info['dtype']}): "
        f"{profile.peak_flops / 1e9:.1f} GFLOP/s, {profile.bandwidth / 1e9:.1f} GB/s, "
        f"overhead {profile.overhead_s * 1e3:.2f} ms, per row {profile.per_row_s * 1e6:.1f} us, "
        f"per token {profile.per_token_s * 1e6:.1f} us; median error {err * 100:.1f}%"
    )
    print(f"wrote {a.profile_out}")
    write_json(
        a.out,
        {
            "benchmark": "calibrate_simulator",
            "machine": m,
            "preset": a.preset,
            "worker": info,
            "profile": vars(profile),
            "samples": samples,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
