"""Prefix caching on a shared-prefix workload: TTFT and throughput with caching on vs off.

Every request is one long system prompt plus a short unique suffix, sent through a real worker
and control plane at a fixed concurrency. The same workload runs twice, once with prefix
caching and once with `--no-prefix-caching`, in one invocation, and the report gives the
ratios (this machine is shared and noisy: compare within a run, not across runs).

    python -m benchmarks.prefix_cache [--preset tiny|small] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from benchmarks.common import (
    RESULTS_DIR,
    StackOptions,
    format_table,
    machine,
    model_dir,
    start_stack,
    write_json,
)
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc


@dataclass
class Timing:
    ttft_s: float
    e2e_s: float
    output_tokens: int


def generate(
    stub: pb_grpc.ControlPlaneStub, prompt: list[int], max_tokens: int, **kw: Any
) -> Timing:
    req = pb.GenerateRequest(
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw
        )
    )
    req.token_ids.ids.extend(prompt)
    t0 = time.perf_counter()
    ttft = None
    n = 0
    for msg in stub.Generate(req, timeout=600):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(msg.token_ids)
    return Timing(ttft or 0.0, time.perf_counter() - t0, n)


def workload(
    vocab: int, num_requests: int, prefix_len: int, suffix_len: int, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [
        system + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(num_requests)
    ]


def run_once(
    model: Path, prompts: list[list[int]], max_tokens: int, concurrency: int, caching: bool
) -> dict[str, Any]:
    opts = StackOptions(cp_args=() if caching else ("--no-prefix-caching",))
    with start_stack(model, opts) as stack:
        channel = grpc.insecure_channel(stack.address)
        stub = pb_grpc.ControlPlaneStub(channel)
        generate(stub, prompts[0], max_tokens)  # warm-up (and, with caching, the first fill)
        lock = threading.Lock()
        timings: list[Timing] = []

        def one(p: list[int]) -> None:
            t = generate(stub, p, max_tokens)
            with lock:
                timings.append(t)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, prompts[1:]))
        wall = time.perf_counter() - t0
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        channel.close()
    ttfts = sorted(t.ttft_s for t in timings)
    out_tokens = sum(t.output_tokens for t in timings)
    prompt_tokens = sum(len(p) for p in prompts[1:])
    return {
        "prefix_caching": caching,
        "requests": len(timings),
        "wall_s": wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)],
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / wall,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "prefix_cache_query_tokens": stats.prefix_cache_query_tokens,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--quick", action="store_true", help="a few short requests (for tests)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "prefix_cache.json")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.prefix_len, a.suffix_len, a.max_tokens, a.concurrency = 6, 128, 8, 4, 3

    model = model_dir(a.preset)
    vocab = 4096 if a.preset == "tiny" else 32000
    prompts = workload(vocab, a.requests, a.prefix_len, a.suffix_len)
    off = run_once(model, prompts, a.max_tokens, a.concurrency, caching=False)
    on = run_once(model, prompts, a.max_tokens, a.concurrency, caching=True)
    report = {
        "benchmark": "prefix_cache",
        "machine": machine(),
        "config": {k: v for k, v in vars(a).items() if k != "out"} | {"out": str(a.out)},
        "off": off,
        "on": on,
        "ttft_speedup": off["ttft_mean_s"] / on["ttft_mean_s"],
        "throughput_ratio": on["total_tokens_per_s"] / off["total_tokens_per_s"],
    }
    rows = [
        [
            "on" if r["prefix_caching"] else "off",
            f"{r['ttft_mean_s'] * 1000:.1f}",
            f"{r['ttft_p90_s'] * 1000:.1f}",
            f"{r['total_tokens_per_s']:.0f}",
            f"{r['output_tokens_per_s']:.0f}",
            r["prefix_cache_hit_tokens"],
        ]
        for r in (off, on)
    ]
    print(
        format_table(
            ["caching", "TTFT mean ms", "TTFT p90 ms", "total tok/s", "output tok/s", "hit tokens"],
            rows,
        )
    )
    print(
        f"TTFT {report['ttft_speedup']:.2f}x faster, throughput "
        f"{report['throughput_ratio']:.2f}x with prefix caching"
    )
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
