"""Beam groups as scheduling units (the search itself is `control_plane/beam.py`).

A group's beams sit next to each other in one queue and move as one unit: scheduled together
(every beam reaches its last token in the same step, or a step catches every beam up to one
short of it), preempted together (swapped with their shared blocks still shared, or
recomputed, when the prefix cache finds their common blocks again), and selected from
together in `update()`. Each function here is the group's counterpart of a request's step in
one of the passes.
"""

from __future__ import annotations

from collections import deque

from control_plane.beam import BeamGroup, Hypothesis, beam_request_id
from control_plane.block_manager import BlockManager, SlotReservation
from control_plane.request import Request, RequestStatus
from control_plane.scheduler.outputs import RequestOutputDelta
from control_plane.scheduler.state import SchedulerState
from control_plane.scheduler.step import StepBuilder
from control_plane.scheduler.units import group_of
from pagedserve.plan import SampledToken


def hold_beam_steps(running: list[Request]) -> bool:
    """Whether beam groups ready for their next step wait for the plan after this one:
    when at least as many beams have a step in flight. A group's step must wait for its
    selection, so with async scheduling groups would otherwise settle into cohorts that
    take turns, each step computing only part of the beams; held, they merge into one
    cohort and every step computes all of them."""
    in_flight = ready = 0
    for r in running:
        if r.beam is not None:
            if r.num_pending_outputs:
                in_flight += 1
            elif r.num_tokens - r.num_computed_tokens == 1:
                ready += 1
    return 0 < ready <= in_flight


def schedule_group(step: StepBuilder, group: BeamGroup, hold: bool = False) -> bool:
    """Schedules a running beam group as one unit; False if it was preempted. Blocks for
    every beam are made free first (preempting newer units), then reserved: a reservation
    that copies a shared block replaces it in the table at once, so one that could not be
    completed would leave a copy the plan never makes."""
    if any(b.num_pending_outputs for b in group.beams):
        return True  # its step is in flight: the next one waits for the selection
    if hold and all(b.num_tokens - b.num_computed_tokens == 1 for b in group.beams):
        return True
    bm = step.state.block_manager
    if group.unforked:
        _fork_recomputed_beams(bm, group)
    nums = _group_tokens(step, group)
    if nums is None:
        return True
    ranges = _ranges(group, nums)
    while bm.num_blocks_to_reserve(ranges) > bm.num_free_gpu_blocks:
        if group.beams[0] in step.preempt_newest():
            return False
    reserved: list[SlotReservation | None] = []
    for beam, n in zip(group.beams, nums, strict=True):
        slots = step.reserve(beam, n) if n else None
        assert slots is not None or not n, f"{beam.req_id}: blocks counted, not there"
        reserved.append(slots)
    _schedule_beams(step, group, nums, reserved)
    return True


def swap_in_group(step: StepBuilder, group: BeamGroup) -> bool:
    """Resumes a swapped beam group, its shared blocks still shared; False if it does
    not fit this step."""
    bm = step.state.block_manager
    nums = _group_tokens(step, group)
    if nums is None:
        return False
    ids = group.ids
    # Sharing survives the swap, so the copies and new blocks are counted on the CPU side.
    if not bm.can_swap_in(ids, extra_blocks=bm.num_blocks_to_reserve(_ranges(group, nums))):
        return False
    moves = bm.swap_in(ids)
    assert moves is not None
    step.swap_in(moves)
    _start_group(step, group, nums, step.state.swapped)
    return True


def admit_group(step: StepBuilder, group: BeamGroup) -> bool:
    """Admits a waiting beam group, each beam from its longest cached prefix, the beams
    of a recomputed group forking what they share with the first one; False, changing
    nothing, if it does not fit this step."""
    bm = step.state.block_manager
    for beam in group.beams:
        if beam.req_id not in group.unforked:
            hit = bm.find_cached_prefix(beam)
            bm.allocate_slots(beam.req_id, hit.num_tokens, prefix=hit)
            beam.num_computed_tokens = hit.num_tokens
    _fork_recomputed_beams(bm, group)
    nums = _group_tokens(step, group)
    if nums is None or bm.num_blocks_to_reserve(_ranges(group, nums)) > bm.num_free_gpu_blocks:
        for beam in group.beams:
            bm.free(beam.req_id)
            beam.num_computed_tokens = 0
        if len(group.beams) > 1:
            group.recompute()
        return False
    _start_group(step, group, nums, step.state.waiting)
    return True


def _group_tokens(step: StepBuilder, group: BeamGroup) -> list[int] | None:
    """Tokens per beam this step: every beam to its last token when all of them fit
    (the group's step: each beam then returns candidates), else each beam's prefill up to
    one short of its last token; None when nothing fits."""
    gaps = [b.num_tokens - b.num_computed_tokens for b in group.beams]
    cap = step.state.config.long_prefill_token_threshold
    if not group.unforked and sum(gaps) <= step.tokens and (cap is None or max(gaps) <= cap):
        return gaps
    nums: list[int] = []
    left = step.tokens
    for beam, gap in zip(group.beams, gaps, strict=True):
        n = 0 if beam.req_id in group.unforked else min(gap - 1, left, cap or gap)
        nums.append(n)
        left -= n
    return nums if any(nums) else None


def _ranges(group: BeamGroup, nums: list[int]) -> list[tuple[str, int, int]]:
    """The token ranges the beams' slots are reserved for, as `num_blocks_to_reserve` takes."""
    return [
        (b.req_id, b.num_computed_tokens, b.num_computed_tokens + n)
        for b, n in zip(group.beams, nums, strict=True)
        if n
    ]


def _fork_recomputed_beams(bm: BlockManager, group: BeamGroup) -> None:
    """Recomputed beams take the blocks they share with the first beam once it has
    computed them (or a plan in flight does: the worker runs plans in order)."""
    first = group.beams[0]
    for beam in group.beams[1:]:
        if beam.req_id not in group.unforked:
            continue
        shared = group.shared_prefix(beam, bm.block_size)
        if first.num_computed_tokens >= shared:
            bm.fork(first.req_id, beam.req_id, shared // bm.block_size)
            beam.num_computed_tokens = shared
            group.unforked.discard(beam.req_id)


def _start_group(
    step: StepBuilder, group: BeamGroup, nums: list[int], queue: deque[Request]
) -> None:
    """Moves a group from the front of `queue` to the running ones and schedules it; its
    blocks were counted free."""
    reserved: list[SlotReservation | None] = []
    for beam, n in zip(group.beams, nums, strict=True):
        assert queue.popleft() is beam
        step.state.start_running(beam)
        slots = step.reserve(beam, n) if n else None
        assert slots is not None or not n
        reserved.append(slots)
    _schedule_beams(step, group, nums, reserved)


def _schedule_beams(
    step: StepBuilder, group: BeamGroup, nums: list[int], reserved: list[SlotReservation | None]
) -> None:
    step.plan.beam_forks.extend(group.pending_forks)
    group.pending_forks = []
    for beam, n, slots in zip(group.beams, nums, reserved, strict=True):
        if n:
            assert slots is not None
            step.add(beam, n, slots)


def select(
    state: SchedulerState, group: BeamGroup, candidates: list[SampledToken]
) -> list[RequestOutputDelta]:
    """Applies a beam group's selection: its next beams (tables reassigned, forks for the
    worker), or its end (the best sequences as deltas, best first)."""
    step = group.select(candidates)
    if step.done:
        results = group.results()
        for beam in list(group.beams):
            state.finish(beam, RequestStatus.FINISHED_STOPPED)
        return [_beam_delta(group, i, h, i == len(results) - 1) for i, h in enumerate(results)]
    first = group.beams[0]
    known = first.status is RequestStatus.RUNNING and not (state.unsent & set(group.ids))
    sources = {
        beam_request_id(group.client_id, slot): group.beams[src].req_id
        for slot, (src, _, _) in enumerate(step.forks)
    }
    state.block_manager.reassign(sources)
    added = group.apply(step, known_to_worker=known)
    if first.status is RequestStatus.WAITING:
        group.recompute()  # preempted while its step ran
    if added:
        queue = state.queue_of(first.status)
        at = list(queue).index(first) + 1
        for k, beam in enumerate(added):
            queue.insert(at + k, beam)
            state.requests[beam.req_id] = beam
        state.children[group.client_id] += [b.req_id for b in added]
    return []


def _beam_delta(group: BeamGroup, index: int, hyp: Hypothesis, last: bool) -> RequestOutputDelta:
    return RequestOutputDelta(
        req_id=beam_request_id(group.client_id, index),
        new_token_ids=hyp.token_ids,
        finished=True,
        finish_reason=hyp.finish_reason,
        parent_id=group.client_id,
        index=index,
        all_finished=last,
        sequence_score=hyp.score,
    )


def check_beam_groups(state: SchedulerState) -> None:
    """Raise AssertionError if a beam group's beams are not together, alike and tracked."""
    groups = {g for r in state.requests.values() if (g := group_of(r)) is not None}
    for group in groups:
        assert state.children.get(group.client_id) == group.ids, f"{group.client_id}: beams"
        assert len(group.scores) == len(group.beams), f"{group.client_id}: scores"
        status = group.beams[0].status
        items = list(state.queue_of(status))
        at = items.index(group.beams[0])
        assert items[at : at + len(group.beams)] == group.beams, (
            f"{group.client_id}: beams not together in the {status.value} queue"
        )
        lengths = {b.num_tokens for b in group.beams}
        assert len(lengths) == 1, f"{group.client_id}: beams of different lengths {lengths}"
        assert not group.pending_forks or status is RequestStatus.RUNNING, (
            f"{group.client_id}: forks pending for beams the worker does not hold"
        )
