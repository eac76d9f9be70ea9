"""KV memory efficiency: paged allocation beside contiguous reservations, over a whole run.

The run is the control plane's own `Scheduler` and `BlockManager` (pure bookkeeping) driven
through W64 with a stand-in worker that samples a fixed token: the block tables are exactly the
ones a real run builds, without a model in the way. After every step:

* paged: token slots holding K/V (each running request's computed tokens) ÷ slots in the
  blocks allocated to running requests; only each request's last block is partly empty.
* contiguous, max length: each running sequence reserves `max_model_len` slots up front (the
  classic pre-allocation of HF-style static caches and of systems without paging).
* contiguous, exact: each reserves prompt + max_tokens up front (an oracle that knows every
  output length; the best any reservation scheme can do).

Then the same KV budget (`--budget-tokens`) is given to each scheme and the workload is
replayed: how many sequences run concurrently (peak and mean over steps). Paged admission is
the scheduler's own (preemption included); a reservation scheme admits FIFO while its whole
reservation fits.

    python -m benchmarks.kv_utilization                 # W64, tiny's max_model_len (2048)
    python -m benchmarks.kv_utilization --quick
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    Workload,
    format_table,
    machine,
    quick_workload,
    random_workload,
    write_json,
)
from control_plane.block_manager import BlockManager
from control_plane.request import Request
from control_plane.scheduler import Scheduler, SchedulerConfig
from pagedserve.plan import SampledToken, StepResult
from pagedserve.sampling_params import SamplingParams

SAMPLED_TOKEN = 7  # any id; requests ignore EOS


@dataclass
class StepSample:
    running: int
    held: int  # slots holding K/V
    paged: int  # slots in allocated blocks
    max_len: int  # slots reserved at max_model_len each
    exact: int  # slots reserved at prompt + max_tokens each


@dataclass
class PagedRun:
    steps: list[StepSample]
    num_preemptions: int


def run_paged(
    wl: Workload,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
) -> PagedRun:
    bm = BlockManager(num_blocks, 0, block_size, enable_prefix_caching=False)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption_mode="recompute",
    )
    sched = Scheduler(cfg, bm)
    reqs: dict[str, Request] = {}
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        req = Request(f"r{i}", list(prompt), sp)
        reqs[req.req_id] = req
        sched.add_request(req)
    steps: list[StepSample] = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        due = {  # the requests this plan left a pending output to
            rid: SampledToken(SAMPLED_TOKEN)
            for rid in plan.num_scheduled_tokens
            if reqs[rid].num_pending_outputs
        }
        sched.update(plan, StepResult(plan.step_id, sampled=due))
        running = [reqs[rid] for rid in plan.num_scheduled_tokens if not reqs[rid].is_finished]
        if not running:
            continue
        steps.append(
            StepSample(
                running=len(running),
                held=sum(r.num_computed_tokens for r in running),
                paged=sum(len(bm.get_block_ids(r.req_id)) for r in running) * block_size,
                max_len=len(running) * max_model_len,
                exact=sum(len(r.prompt_token_ids) + r.sampling.max_tokens for r in running),
            )
        )
    return PagedRun(steps, sched.stats().num_preemptions)


def reserved_concurrency(
    wl: Workload, budget: int, reserve: Sequence[int], max_seqs: int
) -> list[int]:
    """Concurrent sequences per step when each request holds `reserve[i]` slots while it runs.

    FIFO admission while the reservation fits; a request runs 1 + output_len steps (its
    prefill, then one token per step), the same step count the paged run gives it.
    """
    waiting = list(range(wl.num_requests))
    running: dict[int, int] = {}  # request -> steps left
    used = 0
    counts: list[int] = []
    while waiting or running:
        while waiting and len(running) < max_seqs and used + reserve[waiting[0]] <= budget:
            i = waiting.pop(0)
            running[i] = wl.output_lens[i]
            used += reserve[i]
        if not running:
            raise ValueError(
                f"request {waiting[0]} needs {reserve[waiting[0]]} slots, budget {budget}"
            )
        counts.append(len(running))
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                del running[i]
                used -= reserve[i]
    return counts


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def measure(
    wl: Workload, block_size: int, max_model_len: int, budget_tokens: int, max_num_seqs: int
) -> dict[str, Any]:
    # Utilization: a pool large enough that nothing is preempted, so every scheme sees the
    # same running set at every step.
    roomy = run_paged(
        wl,
        -(-wl.num_requests * wl.max_seq_len // block_size) + 1,
        block_size,
        max_model_len,
        max_num_seqs,
    )
    s = roomy.steps

    def util(field: str) -> dict[str, float]:
        per_step = [x.held / getattr(x, field) for x in s]
        total = sum(x.held for x in s) / sum(getattr(x, field) for x in s)
        return {"mean": _mean(per_step), "min": min(per_step), "token_weighted": total}

    utilization = {
        "paged": util("paged"),
        "contiguous_max_len": util("max_len"),
        "contiguous_exact": util("exact"),
    }

    # Concurrency in one budget.
    tight = run_paged(wl, budget_tokens // block_size, block_size, max_model_len, max_num_seqs)
    paged_counts = [x.running for x in tight.steps]
    max_len_counts = reserved_concurrency(
        wl, budget_tokens, [max_model_len] * wl.num_requests, max_num_seqs
    )
    exact = [len(p) + n for p, n in zip(wl.prompts, wl.output_lens, strict=True)]
    exact_counts = reserved_concurrency(wl, budget_tokens, exact, max_num_seqs)
    concurrency = {
        "paged": {
            "peak": max(paged_counts),
            "mean": _mean(paged_counts),
            "steps": len(paged_counts),
            "preemptions": tight.num_preemptions,
        },
        "contiguous_max_len": {
            "peak": max(max_len_counts),
            "mean": _mean(max_len_counts),
            "steps": len(max_len_counts),
        },
        "contiguous_exact": {
            "peak": max(exact_counts),
            "mean": _mean(exact_counts),
            "steps": len(exact_counts),
        },
    }
    return {"utilization": utilization, "concurrency": concurrency}


def print_report(rep: dict[str, Any]) -> None:
    names = {
        "paged": f"paged (block size {rep['block_size']})",
        "contiguous_max_len": f"contiguous, max_model_len ({rep['max_model_len']}) each",
        "contiguous_exact": "contiguous, prompt + max_tokens each",
    }
    u, c = rep["utilization"], rep["concurrency"]
    print(f"\nKV utilization over {rep['workload']['name']} (slots holding K/V ÷ slots allocated)")
    rows = [
        [names[k], u[k]["mean"] * 100, u[k]["min"] * 100, u[k]["token_weighted"] * 100]
        for k in names
    ]
    print(format_table(["allocation", "mean %", "min %", "token-weighted %"], rows))
    print(f"\nconcurrent sequences in a budget of {rep['budget_tokens']:,} token slots")
    rows = [[names[k], c[k]["peak"], c[k]["mean"], c[k]["steps"]] for k in names]
    print(format_table(["allocation", "peak", "mean", "steps"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048, help="tiny and small presets: 2048")
    p.add_argument(
        "--budget-tokens", type=int, default=8192, help="KV slots for the concurrency run"
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="8 short requests")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    wl = (
        quick_workload(a.vocab_size, a.seed)
        if a.quick
        else random_workload(a.vocab_size, a.num_requests, seed=a.seed)
    )
    budget = a.budget_tokens if not a.quick else 1024
    max_model_len = a.max_model_len if not a.quick else 256
    rep = {
        "benchmark": "kv_utilization",
        "mode": "quick" if a.quick else "full",
        "workload": wl.describe(),
        "block_size": a.block_size,
        "max_model_len": max_model_len,
        "budget_tokens": budget,
        "machine": machine(),
        **measure(wl, a.block_size, max_model_len, budget, a.max_num_seqs),
    }
    print_report(rep)
    out = a.out or RESULTS_DIR / "kv_utilization.json"
    write_json(out, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
