"""What the HTTP edge costs: W64 against one `pagedserve up`, three ways, rounds interleaved.

* `grpc`: 64 concurrent `Generate` calls straight to up's control plane, one message per
  completion (`OUTPUT_KIND_FINAL_ONLY`): the offline benchmark's client.
* `http`: 64 concurrent non-streaming `/v1/completions` through the gateway.
* `sse`: 64 streaming clients through the gateway (`pagedserve bench serve`'s load).

Every round draws fresh prompts (W64 lengths: prompts and outputs 32..256 tokens, `ignore_eos`),
the same for the three ways, so no round is served from an earlier one's prefix cache.
Reported: output tokens/s per way (median over rounds) and each HTTP way as a fraction of
`grpc`.

    python -m benchmarks.edge_overhead --preset tiny --dtype float32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    RESULTS_DIR,
    Process,
    Workload,
    format_table,
    free_port,
    machine,
    model_dir,
    random_workload,
    write_json,
)
from benchmarks.offline_throughput import _drive
from benchmarks.serve_compare import one_round
from pagedserve import grpc_security
from pagedserve.cli.bench.workload import BenchRequest

WAYS = ("grpc", "http", "sse")


async def _http(url: str, model: str, wl: Workload) -> float:
    """All completions at once, not streamed; output tokens/s from the usage counts."""
    limits = httpx.Limits(max_connections=len(wl.prompts))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def one(prompt: list[int], n: int) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": n}
            body |= {"temperature": 0.0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        await one(wl.prompts[0][:8], 2)
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(one(p, n) for p, n in zip(wl.prompts, wl.output_lens, strict=True))
        )
        return sum(counts) / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-args", default="", help="more `pagedserve up` flags")
    ap.add_argument("--out", default=str(RESULTS_DIR / "edge_overhead.json"))
    a = ap.parse_args(argv)

    model = model_dir(a.preset)
    name = model.name
    port, grpc_port = free_port(), free_port()
    args = ["up", "--model", str(model), "--served-model-name", name, "--port", str(port)]
    args += ["--grpc-port", str(grpc_port), "--worker-base-port", str(free_port())]
    args += ["--dtype", a.dtype, *a.server_args.split()]
    proc = Process("pagedserve-up", args)
    url, address = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    runs: dict[str, list[float]] = {w: [] for w in WAYS}
    try:
        proc.wait_http(url + "/health", timeout=600)
        security = grpc_security.GrpcSecurity(token=grpc_security.saved_token(address))
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        for r in range(a.rounds):
            wl = random_workload(vocab, seed=2000 + r)
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            for way in order:
                if way == "grpc":
                    elapsed, outs = asyncio.run(_drive(address, wl, security))
                    rate = sum(len(o) for o in outs) / elapsed
                elif way == "http":
                    rate = asyncio.run(_http(url, name, wl))
                else:
                    pairs = zip(wl.prompts, wl.output_lens, strict=True)
                    reqs = [BenchRequest(p, n) for p, n in pairs]
                    rate = one_round(url, name, reqs, True, float("inf"))["output_throughput"]
                runs[way].append(rate)
                print(f"round {r + 1}/{a.rounds} {way}: {rate:,.0f} output tok/s", flush=True)
    finally:
        proc.stop()

    grpc_median = statistics.median(runs["grpc"])
    rows: list[dict[str, Any]] = []
    for way in WAYS:
        med = statistics.median(runs[way])
        rows.append({"way": way, "output_tok_per_s": med, "runs": runs[way],
                     "fraction_of_grpc": med / grpc_median})  # fmt: skip
    print(
        format_table(
            ["way", "out tok/s (median)", "of gRPC", "runs"],
            [
                [
                    r["way"],
                    f"{r['output_tok_per_s']:,.0f}",
                    f"{r['fraction_of_grpc']:.3f}",
                    " ".join(f"{x:,.0f}" for x in r["runs"]),
                ]  # fmt: skip
                for r in rows
            ],
        )
    )
    report: dict[str, Any] = {
        "benchmark": "edge_overhead",
        "preset": a.preset,
        "dtype": a.dtype,
        "server_args": a.server_args,
        "machine": machine(),
        "ways": rows,
    }
    write_json(Path(a.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
