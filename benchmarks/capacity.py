"""Capacity questions answered with the simulator (docs/capacity.md).

fleet          workers needed for 50 and 200 requests/s of ShareGPT-like chat on Llama-3-8B
               under TTFT p99 < 1 s and TPOT p99 < 50 ms, on H100 and on H200: one worker's
               highest rate under the SLOs first, then the fleet that rate implies, checked
               whole (and one worker fewer) at the full rate with KV-aware routing.
routing        KV-aware against least-loaded placement at 8 and 32 H100 workers, every request
               opening with one of 100 distinct 2,048-token system prompts.
redis          the prefix index's load at 32 workers (operations, hashes and entries from the
               simulation), and a real redis-server's memory per entry and time per lookup
               for that many workers and blocks.
control-plane  the control plane's CPU time per step while simulating, and so how many
               workers one process can drive.

    python -m benchmarks.capacity                   # everything (tens of minutes)
    python -m benchmarks.capacity --questions routing --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, format_table, free_port, machine, write_json

SLO_TTFT_P99_MS = 1000.0
SLO_TPOT_P99_MS = 50.0
# The rest of the control plane's step (plan encoding, result decoding, detokenizing and
# streaming) beside the schedule() + update() the simulator times: at 64 rows
# benchmarks/step_overhead.py measured 0.60 ms of the former against 0.46 ms of the latter.
CP_REST_FACTOR = 1 + 0.60 / 0.46


def simulate(argv: list[str]) -> dict[str, Any]:
    from simulator.cli import build_args, run_sweep

    report = run_sweep(build_args(argv))
    return report["runs"][0]["summary"]


def _llama_args(gpu: str, workers: int, rate: float, duration: float, *extra: str) -> list[str]:
    return [
        "--device", gpu, "--model", "llama-3-8b", "--workers", str(workers),
        "--rate", str(rate), "--duration", str(duration), "--workload", "sharegpt",
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "256",
        "--slo-ttft-p99-ms", str(SLO_TTFT_P99_MS), "--slo-tpot-p99-ms", str(SLO_TPOT_P99_MS),
        *extra,
    ]  # fmt: skip


def _meets(s: dict[str, Any]) -> bool:
    return s["ttft"]["p99_ms"] <= SLO_TTFT_P99_MS and s["tpot"]["p99_ms"] <= SLO_TPOT_P99_MS


def fleet(duration: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gpu in ("H100", "H200"):
        # One worker's highest rate under the SLOs, by bisection between 0.5 and 64 req/s.
        lo, hi = 0.5, 64.0
        singles = {}
        while hi / lo > 1.05:
            mid = math.sqrt(lo * hi)
            s = simulate(_llama_args(gpu, 1, mid, duration))
            singles[round(mid, 2)] = {
                "ttft_p99_ms": s["ttft"]["p99_ms"],
                "tpot_p99_ms": s["tpot"]["p99_ms"],
            }
            lo, hi = (mid, hi) if _meets(s) else (lo, mid)
        per_worker = lo
        print(f"  {gpu}: one worker holds the SLOs up to {per_worker:.2f} req/s", flush=True)
        for rate in (50.0, 200.0):
            n = math.ceil(rate / per_worker)
            checks = {}
            # The estimate, then downwards while it holds and upwards until it does.
            while True:
                s = simulate(_llama_args(gpu, n, rate, duration))
                checks[n] = _row(s)
                print(f"    {rate:g} req/s on {n} x {gpu}: {checks[n]}", flush=True)
                if _meets(s):
                    if n - 1 in checks or n == 1:
                        break
                    n -= 1
                else:
                    if n + 1 in checks:
                        n += 1
                        break
                    n += 1
            needed = min(k for k, v in checks.items() if v["meets"])
            out[f"{gpu}@{rate:g}"] = {"workers": needed, "per_worker_rate": per_worker,
                                      "checks": checks}  # fmt: skip
        out[f"{gpu}_singles"] = singles
    return out


def _row(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "meets": _meets(s),
        "ttft_p50_ms": round(s["ttft"]["p50_ms"], 1),
        "ttft_p99_ms": round(s["ttft"]["p99_ms"], 1),
        "tpot_p99_ms": round(s["tpot"]["p99_ms"], 2),
        "output_tok_s": round(s["output_throughput"]),
        "mean_batch": round(s["mean_batch_size"], 1),
        "preemptions": s["num_preemptions"],
        "cp_cores": round(s["control_plane"]["load_cores"], 3),
        "wall_s": round(s["wall_s"], 1),
    }


def routing(duration: float, rate_per_worker: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workers in (8, 32):
        for policy in ("kv-aware", "least-loaded"):
            s = simulate(
                _llama_args(
                    "H100", workers, rate_per_worker * workers, duration,
                    "--routing", policy, "--num-prefixes", "100", "--prefix-len", "2048",
                )
            )  # fmt: skip
            row = {
                **_row(s),
                "prefix_hit_rate": round(s["prefix_hit_rate"], 3),
                "requests_per_s": round(s["request_throughput"], 2),
                "index": s["prefix_index"],
                "completed": s["completed"],
            }
            out[f"{workers}/{policy}"] = row
            print(f"  {workers} workers, {policy}: {row}", flush=True)
    return out


async def _redis_costs(
    url: str, workers: int, keys: int, holders: float, lookup_len: int
) -> dict[str, float]:
    import redis.asyncio as aioredis

    from control_plane.prefix_index import RedisPrefixIndex, WorkerRef

    index = RedisPrefixIndex(url, "llama-3-8b")
    client = aioredis.Redis.from_url(url)
    refs = [WorkerRef(f"10.0.0.{i}:50061", 1) for i in range(workers)]
    base = int((await client.info("memory"))["used_memory"])
    per_worker = max(1, round(keys * holders / workers))
    hashes = [os.urandom(16) for _ in range(keys)]
    # Each worker holds a run of the keys, overlapping so that each key has ~holders holders.
    for i, ref in enumerate(refs):
        start = (i * keys) // workers
        mine = [hashes[(start + j) % keys] for j in range(per_worker)]
        for k in range(0, len(mine), 1000):
            await index.update(ref, mine[k : k + 1000], ())
    used = int((await client.info("memory"))["used_memory"]) - base
    entries = per_worker * workers
    prompt = hashes[:lookup_len]
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        await index.lookup(prompt, refs)
        times.append(time.perf_counter() - t0)
    times.sort()
    await index.close()
    await client.aclose()
    return {
        "keys": keys,
        "entries": entries,
        "bytes_per_entry": used / entries,
        "lookup_ms_median": times[len(times) // 2] * 1e3,
        "lookup_blocks": lookup_len,
        "workers": workers,
    }


def redis(routing_result: dict[str, Any]) -> dict[str, Any]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (make test installs it)")
    sim = routing_result["32/kv-aware"]["index"]
    keys = max(1000, int(sim["peak_keys"]))
    holders = sim["peak_entries"] / max(1, sim["peak_keys"])
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            measured = asyncio.run(
                _redis_costs(f"redis://127.0.0.1:{port}/0", 32, keys, holders, 128)
            )
        finally:
            proc.kill()
            proc.wait()
    return {"simulated": sim, "measured": measured}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--questions", default="fleet,routing,redis,control-plane")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    p.add_argument(
        "--routing-rate", type=float, default=6.0, help="requests/s per worker (routing)"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "capacity.json")
    a = p.parse_args(argv)
    qs = {q.strip() for q in a.questions.split(",")}
    report: dict[str, Any] = {"benchmark": "capacity", "machine": machine(),
                              "duration_s": a.duration}  # fmt: skip
    if "fleet" in qs or "control-plane" in qs:
        print("fleet: Llama-3-8B, ShareGPT-like chat, TTFT p99 < 1 s, TPOT p99 < 50 ms")
        report["fleet"] = fleet(a.duration)
        rows = [
            [k, v["workers"], f"{v['per_worker_rate']:.2f}"]
            for k, v in report["fleet"].items()
            if not k.endswith("_singles")
        ]
        print(format_table(["GPU @ req/s", "workers", "one worker's req/s"], rows))
    if "routing" in qs or "redis" in qs:
        print("routing: 100 system prompts of 2,048 tokens, H100 workers")
        report["routing"] = routing(a.duration, a.routing_rate)
    if "redis" in qs:
        print("redis: the prefix index at 32 workers")
        report["redis"] = redis(report["routing"])
        print(f"  {report['redis']}")
    if "control-plane" in qs:
        cp = {}
        for key, v in report["fleet"].items():
            if key.endswith("_singles"):
                continue
            n = v["workers"]
            cores = v["checks"][n]["cp_cores"] * CP_REST_FACTOR
            cp[key] = {"workers": n, "cores": cores, "workers_per_process": n / cores}
        report["control_plane"] = {"rest_factor": CP_REST_FACTOR, "runs": cp}
        print(f"control plane: {cp}")
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
