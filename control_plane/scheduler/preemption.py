"""Preemption: a running unit (a request, or a beam group) leaves the worker, by swap (its
blocks moved to the CPU pool, resumed later) or recompute (its blocks freed, readmitted from
the waiting queue's front). Either way it keeps its output tokens."""

from __future__ import annotations

from control_plane.request import Request, RequestStatus
from control_plane.scheduler.state import SchedulerState
from control_plane.scheduler.units import group_of
from pagedserve.plan import StepPlan


def preempt(state: SchedulerState, unit: list[Request], plan: StepPlan) -> None:
    """Take a running request, or a beam group, off the worker (`unit`: its requests in queue
    order, as `pop_newest` gives them); the plan drops what the worker holds of them."""
    for req in unit:
        req.num_preemptions += 1
        if req.req_id in state.unsent:
            state.unsent.remove(req.req_id)
        else:
            plan.finished_req_ids.append(req.req_id)
    req = unit[0]
    group = group_of(req)
    if group is not None:
        group.pending_forks = []  # the beams are sent in full when they resume
    # A fork parent with all its prompt in flight forks when readmitted (see
    # `control_plane/scheduler/scheduler.py`): swapped, it would resume with nothing to
    # compute. A beam group whose beams have not all forked from the first again recomputes.
    parent_done = req.is_fork_parent and req.num_computed_tokens == req.num_tokens_to_compute
    regrowing = group is not None and bool(group.unforked)
    if state.config.preemption_mode == "swap" and not parent_done and not regrowing:
        moves = state.block_manager.swap_out([r.req_id for r in unit])
        if moves is not None:  # else the CPU pool is full: recompute instead
            plan.swap_out.extend(moves)
            for r in reversed(unit):
                r.status = RequestStatus.SWAPPED
                # Victims go newest-first, so appendleft keeps the queue oldest-first.
                state.swapped.appendleft(r)
            state.counters.preemptions["swap"] += 1
            state.counters.swapped_out_blocks += len(moves)
            return
    for r in reversed(unit):
        state.block_manager.free(r.req_id)
        r.num_computed_tokens = 0
        r.status = RequestStatus.WAITING
        state.waiting.appendleft(r)
    if group is not None:
        group.recompute()
    state.counters.preemptions["recompute"] += 1
