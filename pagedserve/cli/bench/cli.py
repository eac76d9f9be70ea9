"""The `pagedserve bench` subcommands; `register_bench` adds them to the main parser."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any

from pagedserve import envs
from pagedserve.cli.bench.workload import (
    BenchRequest,
    LengthRange,
    chat_requests,
    random_requests,
    shared_prefix_requests,
)
from pagedserve.heap import freeze_heap


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: e.g. 1,2,4,inf") from None


def _lengths(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register_bench(sub: Any) -> None:
    """Adds `bench serve` to the `pagedserve` subcommands."""
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    s = bench_sub.add_parser(
        "serve",
        help="OpenAI-API load generator: TTFT, TPOT, ITL, latency, throughput",
        description="Streams completions from a running gateway (pagedserve up) and reports "
        "latency percentiles and throughput per request rate.",
    )
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the gateway's URL")
    s.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    s.add_argument(
        "--api-key",
        default=envs.get().api_key,
        help="sent as Authorization: Bearer KEY [env PAGEDSERVE_API_KEY]",
    )
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument(
        "--dataset",
        choices=["random", "shared-prefix", "chat"],
        default="random",
        help="chat: 64 real chat prompts (for SmolLM2), sent to /v1/chat/completions with "
        "--output-len's upper bound as max_tokens; pair with --no-ignore-eos",
    )
    s.add_argument("--prompt-len", type=_lengths, default=LengthRange(32, 256), help="N or LO:HI")
    s.add_argument("--output-len", type=_lengths, default=LengthRange(32, 256), help="N or LO:HI")
    s.add_argument("--prefix-len", type=int, default=128, help="shared-prefix: prefix tokens")
    s.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    s.add_argument(
        "--vocab-size", type=int, default=4096, help="token ids are drawn below this (tiny: 4096)"
    )
    s.add_argument(
        "--request-rate",
        type=_rates,
        default=(math.inf,),
        help="requests/s, comma-separated for a sweep; inf sends all at once",
    )
    s.add_argument("--arrival", choices=["poisson", "burst"], default="poisson")
    s.add_argument("--burst-size", type=int, default=8, help="requests per burst (--arrival burst)")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let a completion end at the model's EOS; without it, each runs to its max_tokens",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--num-warmup", type=int, default=1)
    s.add_argument(
        "--no-progress", dest="progress", action="store_false", help="print no progress line"
    )
    s.add_argument("--out", type=Path, default=None, help="JSON report path")
    s.add_argument("--plot", type=Path, default=None, help="write a PNG of the results")
    s.set_defaults(func=cmd_bench_serve)


def build_requests(a: argparse.Namespace) -> list[BenchRequest]:
    if a.dataset == "chat":
        return chat_requests(a.num_prompts, a.output_len.hi)
    if a.dataset == "shared-prefix":
        return shared_prefix_requests(
            a.num_prompts,
            a.num_prefixes,
            a.prefix_len,
            a.prompt_len,
            a.output_len,
            a.vocab_size,
            a.seed,
        )
    return random_requests(a.num_prompts, a.prompt_len, a.output_len, a.vocab_size, a.seed)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from pagedserve.cli.bench.serve import BenchError, ServeConfig, run

    try:
        cfg = ServeConfig(
            base_url=a.base_url,
            model=a.model,
            api_key=a.api_key,
            request_rates=a.request_rate,
            arrival=a.arrival,
            burst_size=a.burst_size,
            max_concurrency=a.max_concurrency,
            ignore_eos=a.ignore_eos,
            seed=a.seed,
            num_warmup=a.num_warmup,
            progress=a.progress,
        )
    except ValueError as exc:
        raise SystemExit(f"pagedserve bench serve: {exc}") from None
    report: dict[str, Any] = {
        "benchmark": "serve",
        "base_url": a.base_url,
        "dataset": a.dataset,
        "num_prompts": a.num_prompts,
        "prompt_len": [a.prompt_len.lo, a.prompt_len.hi],
        "output_len": [a.output_len.lo, a.output_len.hi],
        "arrival": a.arrival,
        "ignore_eos": a.ignore_eos,
        "max_concurrency": a.max_concurrency,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
    }
    requests = build_requests(a)
    freeze_heap()  # the client's own collections must not stretch what it measures
    try:
        report.update(asyncio.run(run(cfg, requests)))
    except BenchError as exc:
        raise SystemExit(f"pagedserve bench serve: {exc}") from None
    print(format_report(report))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.out}")
    if a.plot is not None:
        from pagedserve.cli.bench.plot import write_plot

        write_plot(report, a.plot)
        print(f"wrote {a.plot}")
    failed = sum(r["failed"] for r in report["runs"])
    return 1 if failed else 0


def format_report(report: dict[str, Any]) -> str:
    headers = [
        "rate",
        "done",
        "req/s",
        "out tok/s",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "TPOT mean",
        "TPOT p99",
        "ITL p99",
        "E2E mean",
        "E2E p99",
    ]
    rows = []
    for r in report["runs"]:
        rows.append(
            [
                str(r["request_rate"]),
                f"{r['completed']}/{r['num_requests']}",
                f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}",
                *(
                    f"{r[m][k]:.1f}"
                    for m, k in (
                        ("ttft", "mean_ms"),
                        ("ttft", "p50_ms"),
                        ("ttft", "p99_ms"),
                        ("tpot", "mean_ms"),
                        ("tpot", "p99_ms"),
                        ("itl", "p99_ms"),
                        ("e2e", "mean_ms"),
                        ("e2e", "p99_ms"),
                    )
                ),
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = [
        f"model {report['model']}, {report['num_prompts']} requests, latencies in ms",
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    for r in report["runs"]:
        for err in r["errors"]:
            lines.append(f"error (rate {r['request_rate']}): {err}")
    return "\n".join(lines)
