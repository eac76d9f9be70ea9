"""Read-only views of a scheduler's state: the backlog admission prices, a plan's rows and
shape, the statistics, and the integrity check that tests run after every step."""

from __future__ import annotations

from control_plane.request import RequestStatus
from control_plane.scheduler.beams import check_beam_groups
from control_plane.scheduler.outputs import Backlog, SchedulerStats
from control_plane.scheduler.state import SchedulerState
from control_plane.scheduler.units import running_seats, seats_asked
from pagedserve.plan import StepPlan, StepShape


def backlog(state: SchedulerState) -> Backlog:
    """The work ahead of a request added now (FCFS: everything already here)."""
    prefill = 0
    for r in state.running:
        prefill += max(0, r.num_tokens_to_compute - r.num_computed_tokens - 1)
    seats = running_seats(state.running)
    bm = state.block_manager
    blocks = 0
    for r in state.swapped:
        seats += seats_asked(r)
        prefill += max(0, r.num_tokens_to_compute - r.num_computed_tokens - 1)
        blocks += len(bm.get_cpu_block_ids(r.req_id))
    for r in state.waiting:
        seats += seats_asked(r)
        prefill += r.num_tokens_to_compute - r.num_computed_tokens
        blocks += bm.num_blocks_for(r.num_tokens)
    return Backlog(len(state.running), prefill, seats, blocks, bm.num_free_gpu_blocks)


def sampling_rows(state: SchedulerState, plan: StepPlan) -> frozenset[str]:
    """The requests of a plan awaiting update() that will sample a token in it (what its
    StepResult must carry)."""
    for f in state.in_flight:
        if f.plan is plan:
            return f.sampling
    raise ValueError(f"step {plan.step_id} is not awaiting update()")


def plan_shape(state: SchedulerState, plan: StepPlan) -> StepShape:
    """The shape of a plan just made by schedule() (see `StepShape`)."""
    pairs = ctx = 0
    get = state.requests.get
    for req_id, n in plan.num_scheduled_tokens.items():
        req = get(req_id)
        if req is None:
            continue
        before = req.num_computed_tokens - n  # schedule() advanced it already
        pairs += n * before + n * (n + 1) // 2
        ctx += before
    sampled = len(sampling_rows(state, plan)) if plan.num_scheduled_tokens else 0
    return StepShape(
        rows=len(plan.num_scheduled_tokens),
        tokens=plan.total_num_scheduled_tokens,
        sampled_rows=sampled,
        attention_pairs=pairs,
        context_tokens=ctx,
        swapped_blocks=len(plan.swap_in) + len(plan.swap_out),
    )


def stats(state: SchedulerState) -> SchedulerStats:
    c = state.counters
    bm = state.block_manager
    return SchedulerStats(
        num_running=len(state.running),
        num_waiting=len(state.waiting),
        num_swapped=len(state.swapped),
        gpu_kv_usage=bm.gpu_usage,
        cpu_kv_usage=bm.cpu_usage,
        num_steps=c.num_steps,
        num_preemptions_recompute=c.preemptions["recompute"],
        num_preemptions_swap=c.preemptions["swap"],
        num_chunked_prefill_steps=c.chunked_prefill_steps,
        num_swapped_out_blocks=c.swapped_out_blocks,
        num_swapped_in_blocks=c.swapped_in_blocks,
        num_computed_tokens=c.computed_tokens,
        num_forks=c.forks,
        num_copied_blocks=c.copied_blocks,
        num_used_gpu_blocks=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
        num_gpu_block_refs=bm.num_gpu_block_refs,
        peak_used_gpu_blocks=c.peak_used_gpu_blocks,
        prefix_cache=bm.prefix_cache_stats(),
    )


def check_integrity(state: SchedulerState) -> None:
    """Raise AssertionError if queues, statuses and block tables disagree."""
    bm = state.block_manager
    bs = bm.block_size
    seen: set[str] = set()
    for status in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED):
        for req in state.queue_of(status):
            assert req.req_id not in seen, f"{req.req_id} is queued twice"
            seen.add(req.req_id)
            assert req.status is status, f"{req.req_id} is {req.status} in the {status} queue"
            assert state.requests.get(req.req_id) is req, f"{req.req_id} is not tracked"
            pending = sum(
                f.requests.get(req.req_id) is req and req.req_id in f.sampling
                for f in state.in_flight
            )
            assert req.num_pending_outputs == pending, f"{req.req_id}: pending outputs"
            assert 0 <= req.num_computed_tokens < req.num_tokens or (
                state.in_flight and req.num_computed_tokens <= req.num_tokens_to_compute
            ), f"{req.req_id}: computed {req.num_computed_tokens} of {req.num_tokens}"
    assert seen == set(state.requests), "tracked requests missing from every queue"
    seats = running_seats(state.running)
    assert seats <= state.config.max_num_seqs, f"{seats} seats > max_num_seqs"
    assert state.unsent <= {r.req_id for r in state.running}, "unsent requests not running"
    for parent_id, child_ids in state.children.items():
        assert child_ids and parent_id not in state.requests, f"{parent_id}: stale fork"
        for c in child_ids:
            assert state.requests[c].parent_id == parent_id, f"{c}: not a child of {parent_id}"
    for req in state.requests.values():
        if req.parent_id is not None:
            assert req.req_id in state.children.get(req.parent_id, ()), f"{req.req_id}: orphan"
    for req in state.running:
        assert not bm.is_swapped(req.req_id), f"running {req.req_id} holds CPU blocks"
        covered = len(bm.get_block_ids(req.req_id)) * bs
        assert covered >= req.num_computed_tokens, f"{req.req_id}: blocks do not cover KV"
    for req in state.swapped:
        assert bm.is_swapped(req.req_id), f"swapped {req.req_id} holds no CPU table"
        covered = len(bm.get_cpu_block_ids(req.req_id)) * bs
        assert covered >= req.num_computed_tokens, f"{req.req_id}: blocks do not cover KV"
    for req in state.waiting:
        assert req.num_computed_tokens == 0, f"waiting {req.req_id} has computed tokens"
    check_beam_groups(state)
    holders = {r.req_id for r in state.running} | {r.req_id for r in state.swapped}
    assert bm.request_ids() <= holders, f"blocks held by {bm.request_ids() - holders}"
    bm.check_integrity()
