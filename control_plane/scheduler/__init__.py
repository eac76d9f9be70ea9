"""Iteration-level scheduling: which requests run in the next step, and how many tokens each.

Pure bookkeeping over `Request`s and a `BlockManager`: `schedule()` returns a `StepPlan`, the
worker executes it, `update(plan, result)` applies the `StepResult`. There is no prefill/decode
split: a step mixes both, each request's num_computed_tokens catching up with its num_tokens.

    scheduler.py   Scheduler: requests in and out, schedule(), update(); async scheduling
    state.py       its queues and records between steps, and the moves between queues
    passes.py      the three queue passes of a step (running, swapped, waiting) and their order
    step.py        StepBuilder: one step's plan and token budget; copy-on-write in the plan
    units.py       the unit a pass schedules: a request, or a beam group; seats
    preemption.py  a running unit off the worker, by swap or recompute
    forks.py       parallel sampling (n > 1): a parent forked into children sharing its blocks
    beams.py       beam groups as units (the search: `control_plane/beam.py`)
    stop.py        token-level stop checks
    views.py       backlog, plan shape, stats, check_integrity
    config.py      SchedulerConfig
    outputs.py     RequestOutputDelta, SchedulerStats, Backlog
"""

from control_plane.scheduler.config import PreemptionMode, SchedulerConfig
from control_plane.scheduler.outputs import Backlog, RequestOutputDelta, SchedulerStats
from control_plane.scheduler.scheduler import MAX_PLANS_AWAITING_UPDATE, Scheduler

__all__ = [
    "MAX_PLANS_AWAITING_UPDATE",
    "Backlog",
    "PreemptionMode",
    "RequestOutputDelta",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
