"""Streamed serving through HTTP: `pagedserve up` beside vLLM's OpenAI server (its CPU build),
one load client, rounds interleaved in one run, both servers in the same dtype on the same
checkpoint directory; both start before the first round and stay up.

Workloads (`--workload`):

* `w64`: 64 completions of random token ids (prompts 32..256, outputs 32..256 tokens,
  `ignore_eos`), a fresh seed every round, so no round hits a prefix cached by an earlier one.
* `chat` (SmolLM2 only): the 64 chat prompts of `pagedserve.cli.bench.chat_prompts`
  (`/v1/chat/completions`, greedy, `max_tokens` 512, natural stops at `<|im_end|>`); every
  round opens each question differently (`LEAD_INS`) for the same reason.

All requests are sent at once from 64 streaming clients (`stream: true`), or at the Poisson
rates of `--request-rate` (a sweep: each rate is a round of its own per server). Both servers
see the same requests in a round, and the order alternates (A B, B A, ...). Each server first
serves `--warmup-rounds` unmeasured rounds of other prompts: the first round after every server
has started measured 10-25% slow for whichever server took it.

Reported per round and as medians: output tokens/s (usage counts over the round's wall time),
TTFT and ITL percentiles, and the ratio pagedserve / vLLM.

    python -m benchmarks.serve_compare --preset smollm2 --workload chat --vllm-venv VENV
    python -m benchmarks.serve_compare --preset small --dtype bfloat16 --vllm-venv VENV
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.baselines import VLLM_ENV, VLLM_INSTALL_HINT, vllm_python
from benchmarks.common import (
    RESULTS_DIR,
    Process,
    format_table,
    free_port,
    machine,
    model_dir,
    write_json,
)
from pagedserve.cli.bench.serve import ServeConfig, run
from pagedserve.cli.bench.workload import BenchRequest, LengthRange, chat_requests, random_requests
from pagedserve.cli.model_source import DEFAULT_MODEL_NAME, ensure_default_model
from pagedserve.heap import freeze_heap

W64_LENGTHS = LengthRange(32, 256)
WARMUP_ROUND = 10_000  # the warm-up rounds' prompts: none of a measured round's


def start_pagedserve(
    model: Path, name: str, dtype: str, extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[Process, str]:
    port = free_port()
    args = ["up", "--model", str(model), "--served-model-name", name, "--port", str(port)]
    args += ["--grpc-port", str(free_port()), "--worker-base-port", str(free_port())]
    # The KV budget vLLM is given (VLLM_CPU_KVCACHE_SPACE): the same pool on both sides, so that
    # neither turns requests away (429) or preempts where the other has room.
    args += ["--kv-cache-memory", f"{VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']}GiB"]
    args += ["--dtype", dtype, *extra]
    proc = Process("pagedserve-up", args, env=env)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", timeout=600)
    return proc, url


def start_vllm(py: Path, model: Path, name: str, dtype: str) -> tuple[Process, str]:
    port = free_port()
    args = ["--model", str(model), "--served-model-name", name]
    args += ["--dtype", dtype, "--enforce-eager", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = Process(
        "vllm-server",
        args,
        env={**env, **VLLM_ENV},
        program=(str(py), "-m", "vllm.entrypoints.openai.api_server"),
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", timeout=600)
    return proc, url


def variant_env(words: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Leading NAME=VALUE words (as `env` takes them) and the `up` arguments after them."""
    env: dict[str, str] = {}
    words = list(words)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def round_requests(
    workload: str, round_: int, num: int, max_tokens: int, vocab_size: int
) -> list[BenchRequest]:
    if workload == "chat":
        return chat_requests(num, max_tokens, round_)
    return random_requests(num, W64_LENGTHS, W64_LENGTHS, vocab_size, seed=1000 + round_)


def one_round(
    url: str, name: str, requests: list[BenchRequest], ignore_eos: bool, rate: float
) -> dict[str, Any]:
    cfg = ServeConfig(url, model=name, ignore_eos=ignore_eos, progress=False, request_rates=(rate,))
    report = asyncio.run(run(cfg, requests))
    summary: dict[str, Any] = report["runs"][0]
    summary.pop("requests", None)
    return summary


def _row(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(f: Any) -> float:
        return float(statistics.median(f(r) for r in runs))

    return {
        "system": name,
        "output_tok_per_s": med(lambda r: r["output_throughput"]),
        "output_tok_per_s_runs": [r["output_throughput"] for r in runs],
        "ttft_p50_ms": med(lambda r: r["ttft"]["p50_ms"]),
        "ttft_p99_ms": med(lambda r: r["ttft"]["p99_ms"]),
        "itl_p50_ms": med(lambda r: r["itl"]["p50_ms"]),
        "itl_p99_ms": med(lambda r: r["itl"]["p99_ms"]),
        "output_tokens_runs": [r["output_tokens"] for r in runs],
        "failed": sum(r["failed"] for r in runs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=["tiny", "small", "smollm2"], default="smollm2")
    p.add_argument("--workload", choices=["w64", "chat"], default=None,
                   help="default: chat on smollm2, w64 on the random presets")  # fmt: skip
    p.add_argument("--vllm-venv", type=Path, default=None, help="virtualenv with vllm-cpu")
    p.add_argument("--rounds", type=int, default=4, help="rounds per server and rate")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="unmeasured rounds per server first (the first round after every "
                   "server has started runs slow for whichever server takes it)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512, help="chat: the cap per answer")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s, Poisson (inf: all at once); several make a sweep")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--pagedserve-variant",
        default=None,
        metavar="ARGS",
        help="also serve `pagedserve up ARGS` (e.g. '--num-threads 1', or with leading "
        "NAME=VALUE environment variables) in the same rounds; another checkout's code: "
        "'PYTHONSAFEPATH=1 PYTHONPATH=DIR' (without the first, `python -m` puts the working "
        "directory, this checkout, ahead of PYTHONPATH)",
    )
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    workload = a.workload or ("chat" if a.preset == "smollm2" else "w64")
    if workload == "chat" and a.preset != "smollm2":
        p.error("the chat workload needs the instruct model: --preset smollm2")

    host = machine()
    if a.preset == "smollm2":
        model, name = ensure_default_model(), DEFAULT_MODEL_NAME
    else:
        model, name = model_dir(a.preset), a.preset
    from gpu_worker.models.config import ModelConfig

    vocab_size = ModelConfig.from_dir(model).vocab_size
    py = vllm_python(a.vllm_venv)
    servers: dict[str, tuple[Process, str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        servers["pagedserve"] = start_pagedserve(model, name, a.dtype)
        if a.pagedserve_variant:
            env, extra = variant_env(shlex.split(a.pagedserve_variant))
            servers[f"pagedserve {a.pagedserve_variant}"] = start_pagedserve(
                model, name, a.dtype, extra, env
            )
        if py is not None:
            servers["vllm"] = start_vllm(py, model, name, a.dtype)
        else:
            print(f"vLLM skipped: no working vllm; install it with: {VLLM_INSTALL_HINT}")
        runs = {f"{n}@{rate:g}": [] for rate in a.request_rate for n in servers}
        freeze_heap()  # the load client's own collections must not stretch what it measures
        for w in range(a.warmup_rounds):
            reqs = round_requests(
                workload, WARMUP_ROUND + w, a.num_prompts, a.max_tokens, vocab_size
            )
            for n in servers:
                one_round(servers[n][1], name, reqs, workload == "w64", float("inf"))
                print(f"warm-up round {w + 1}/{a.warmup_rounds} {n} (not counted)", flush=True)
        for r in range(a.rounds):
            for rate in a.request_rate:
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                reqs = round_requests(workload, r, a.num_prompts, a.max_tokens, vocab_size)
                for n in order:
                    summary = one_round(servers[n][1], name, reqs, workload == "w64", rate)
                    runs[f"{n}@{rate:g}"].append(summary)
                    print(
                        f"round {r + 1}/{a.rounds} rate {rate:g} {n}: "
                        f"{summary['output_throughput']:,.0f} output tok/s, TTFT p50 "
                        f"{summary['ttft']['p50_ms']:,.0f} ms, "
                        f"{summary['output_tokens']} tokens, {summary['failed']} failed",
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            proc.stop()

    rows = [_row(key, rs) for key, rs in runs.items()]
    for row in rows:
        rate = row["system"].split("@")[1]
        ours = next(r for r in rows if r["system"] == f"pagedserve@{rate}")
        row["pagedserve_ratio"] = ours["output_tok_per_s"] / row["output_tok_per_s"]
    report = {
        "benchmark": "serve_compare",
        "preset": a.preset,
        "model": name,
        "dtype": a.dtype,
        "workload": {
            "name": workload,
            "num_prompts": a.num_prompts,
            "max_tokens": a.max_tokens if workload == "chat" else "32..256",
            "prompt_tokens": "chat" if workload == "chat" else "32..256",
            "request_rates": [str(r) for r in a.request_rate],
            "rounds": a.rounds,
            "warmup_rounds": a.warmup_rounds,
        },
        "machine": host,
        "systems": rows,
        "rounds": runs,
    }
    print(
        format_table(
            [
                "system",
                "out tok/s (median)",
                "pagedserve ×",
                "TTFT p50 ms",
                "ITL p50 ms",
                "failed",
                "runs",
            ],
            [
                [
                    row["system"],
                    row["output_tok_per_s"],
                    row["pagedserve_ratio"],
                    row["ttft_p50_ms"],
                    row["itl_p50_ms"],
                    row["failed"],
                    " ".join(f"{x:,.0f}" for x in row["output_tok_per_s_runs"]),
                ]
                for row in rows
            ],
        )
    )
    out = a.out or RESULTS_DIR / f"serve_compare_{a.preset}_{workload}_{a.dtype}.json"
    write_json(out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
