"""`pagedserve simulate`: the real control plane on a virtual clock against a cost model.

    pagedserve simulate --device H100 --model llama-3-8b --workers 4 --rate 10,20,40 \\
        --duration 600 --workload sharegpt --allocation paged,orca-oracle --out sim.json

Every combination of --allocation, --routing and --rate is one run; each prints a row and
all go into the JSON report (--out) and the plots (--plot DIR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any

from simulator.config import ALLOCATIONS, ROUTINGS, SimConfig
from simulator.hardware import GIB, GPUS, MODELS
from simulator.workload import LENGTHS


def _list(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items

    return parse


def _rates(text: str) -> list[float]:
    try:
        rates = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: e.g. 1,2,4 or inf") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return rates


def register_simulate(sub: Any) -> None:
    s = sub.add_parser(
        "simulate",
        help="the real control plane on a virtual clock against GPU cost models",
        description="Runs the control plane's scheduler, block manager and router on a "
        "virtual clock against a cost model of a named GPU and model. Every combination of "
        "--allocation, --routing and --rate is one run; each prints a row, and all go into "
        "the JSON report (--out) and the plots (--plot DIR).",
    )
    hw = s.add_argument_group("hardware and model")
    hw.add_argument(
        "--device",
        default="H100",
        help=f"{', '.join(GPUS)}, cpu (the fitted profile) or a profile JSON",
    )
    hw.add_argument("--model", default="llama-3-8b", help=f"{', '.join(MODELS)} or a config.json")
    hw.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each worker")
    hw.add_argument("--workers", type=int, default=1)
    hw.add_argument("--flops-efficiency", type=float, default=None)
    hw.add_argument("--bandwidth-efficiency", type=float, default=None)
    hw.add_argument("--step-overhead-ms", type=float, default=None)
    eng = s.add_argument_group("engine")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--num-gpu-blocks", type=int, default=None, help="default: from memory")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--swap-space-gib", type=float, default=4.0)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument(
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=SimConfig.max_prefill_tokens_with_decodes,
    )
    eng.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    eng.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    eng.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    eng.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    eng.add_argument(
        "--allocation",
        type=_list(ALLOCATIONS),
        default=["paged"],
        help=f"comma-separated: {', '.join(ALLOCATIONS)}",
    )
    eng.add_argument(
        "--routing",
        type=_list(ROUTINGS),
        default=["kv-aware"],
        help=f"comma-separated: {', '.join(ROUTINGS)}",
    )
    wl = s.add_argument_group("workload")
    wl.add_argument("--workload", choices=[*LENGTHS, "fixed"], default="sharegpt")
    wl.add_argument("--prompt-len", type=int, default=256, help="--workload fixed")
    wl.add_argument("--output-len", type=int, default=256, help="--workload fixed")
    wl.add_argument("--rate", type=_rates, default=[1.0], help="requests/s, comma-separated")
    wl.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    wl.add_argument("--num-requests", type=int, default=None, help="instead of --duration")
    wl.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    wl.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: burstiness")
    wl.add_argument("--num-prefixes", type=int, default=0, help="shared system prompts")
    wl.add_argument("--prefix-len", type=int, default=0)
    wl.add_argument("--turns", type=int, default=1, help="turns per session")
    wl.add_argument("--think-time", type=float, default=5.0, help="seconds between turns")
    wl.add_argument("--trace", type=Path, default=None, help="a `bench serve --out` report")
    wl.add_argument("--trace-run", type=int, default=0)
    wl.add_argument("--seed", type=int, default=0)
    out = s.add_argument_group("output")
    out.add_argument("--slo-ttft-p99-ms", type=float, default=None)
    out.add_argument("--slo-tpot-p99-ms", type=float, default=None)
    out.add_argument(
        "--latency-threshold",
        type=float,
        default=None,
        help="s/token: report the highest swept rate each policy sustains under it",
    )
    out.add_argument("--out", type=Path, default=None, help="JSON report")
    out.add_argument("--plot", type=Path, default=None, help="directory for PNGs")
    s.set_defaults(func=cmd_simulate)


def build_args(argv: list[str]) -> argparse.Namespace:
    """`pagedserve simulate` arguments parsed from a list (for scripts)."""
    parser = argparse.ArgumentParser(prog="pagedserve")
    register_simulate(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def cmd_simulate(a: argparse.Namespace) -> int:
    from simulator.report import format_table, write_plots

    try:
        report = run_sweep(a)
    except ValueError as exc:
        raise SystemExit(f"pagedserve simulate: {exc}") from None
    print(format_table(report["runs"]))
    for label, rate in report.get("sustained_rates", {}).items():
        print(f"sustained under {a.latency_threshold} s/token: {label}: {rate}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")
    if a.plot is not None:
        for p in write_plots(report, a.plot):
            print(f"wrote {p}")
    return 0


def run_sweep(a: argparse.Namespace) -> dict[str, Any]:
    from simulator.cluster import Simulation
    from simulator.cost import CostModel, resolve_profile
    from simulator.hardware import resolve_model
    from simulator.report import summarize, sustained_rate
    from simulator.workload import SimRequest, Workload, WorkloadSpec, trace_requests

    overrides = {
        k: v
        for k, v in (
            ("flops_efficiency", a.flops_efficiency),
            ("bandwidth_efficiency", a.bandwidth_efficiency),
            ("overhead_s", None if a.step_overhead_ms is None else a.step_overhead_ms / 1e3),
        )
        if v is not None
    }
    profile = resolve_profile(a.device, **overrides)
    model = resolve_model(a.model)
    cost = CostModel(profile, model, a.tp, a.block_size)
    max_len = a.max_model_len or model.max_model_len
    if a.trace is None and (a.duration is None) == (a.num_requests is None):
        raise ValueError("give --duration or --num-requests (or --trace)")
    runs = []
    for allocation in a.allocation:
        for routing in a.routing:
            for rate in [math.nan] if a.trace is not None else a.rate:
                cfg = SimConfig(
                    num_workers=a.workers,
                    block_size=a.block_size,
                    num_gpu_blocks=a.num_gpu_blocks,
                    gpu_memory_utilization=a.gpu_memory_utilization,
                    swap_space_bytes=a.swap_space_gib * GIB,
                    max_num_seqs=a.max_num_seqs,
                    max_num_batched_tokens=a.max_num_batched_tokens,
                    max_prefill_tokens_with_decodes=a.max_prefill_tokens_with_decodes,
                    max_model_len=max_len,
                    preemption=a.preemption,
                    allocation=allocation,
                    routing=routing,
                    enable_prefix_caching=a.prefix_caching,
                    async_scheduling=a.async_scheduling,
                )
                spec = WorkloadSpec(
                    lengths=a.workload,
                    prompt_len=a.prompt_len,
                    output_len=a.output_len,
                    rate=rate if a.trace is None else 1.0,
                    duration_s=a.duration if a.trace is None else None,
                    num_requests=a.num_requests if a.trace is None else 0,
                    arrival=a.arrival,
                    cv=a.cv,
                    num_prefixes=a.num_prefixes,
                    prefix_len=a.prefix_len,
                    turns=a.turns,
                    think_time_s=a.think_time,
                    vocab_size=min(model.vocab_size, 1 << 20),
                    max_model_len=max_len,
                    seed=a.seed,
                )
                workload = Workload(spec)
                requests: list[SimRequest] | None = None
                if a.trace is not None:
                    requests = trace_requests(a.trace, a.trace_run, spec.vocab_size, a.seed)
                sim = Simulation(cfg, cost, workload)
                result = sim.run(requests)
                summary = summarize(result)
                summary["workload"] = workload.stats.summary()
                summary["slo_met"] = _slo(summary, a)
                runs.append(
                    {
                        "allocation": allocation,
                        "routing": routing,
                        "rate": "trace" if a.trace is not None else rate,
                        "summary": summary,
                    }
                )
    report: dict[str, Any] = {
        "benchmark": "simulate",
        "device": profile.name,
        "model": model.name,
        "tp": a.tp,
        "workers": a.workers,
        "workload": a.workload if a.trace is None else str(a.trace),
        "profile": {k: v for k, v in vars(profile).items() if k != "fitted"},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "runs": runs,
    }
    if a.latency_threshold is not None and a.trace is None:
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            groups.setdefault(f"{r['allocation']} / {r['routing']}", []).append(r)
        report["sustained_rates"] = {
            k: sustained_rate(v, a.latency_threshold) for k, v in groups.items()
        }
    return report


def _slo(summary: dict[str, Any], a: argparse.Namespace) -> bool | None:
    if a.slo_ttft_p99_ms is None and a.slo_tpot_p99_ms is None:
        return None
    ok = True
    if a.slo_ttft_p99_ms is not None:
        ok &= summary["ttft"]["p99_ms"] <= a.slo_ttft_p99_ms
    if a.slo_tpot_p99_ms is not None:
        ok &= summary["tpot"]["p99_ms"] <= a.slo_tpot_p99_ms
    return ok
