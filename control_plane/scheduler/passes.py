"""The three queue passes of a step, in the order `Scheduler.schedule()` runs them:

    1. running requests, oldest first: each gets min(tokens left, budget left, long-prefill
       threshold) tokens and the blocks to hold them (copy-on-write for shared blocks it
       writes into). Out of blocks → preempt the newest running request (possibly the one
       being scheduled) by recompute or swap, and retry. Where a running request decodes in
       the step, the chunks of more than one token (prompts, recomputation) share at most
       max_prefill_tokens_with_decodes of the budget, here and in steps 2 and 3.
    2. swapped requests, oldest first, only if step 1 preempted nothing: swap in + schedule.
    3. waiting requests, FIFO, only if nothing was preempted and nothing is left swapped; the
       first that does not fit ends admission (no overtaking). An admitted request starts
       from its longest cached prefix (num_computed_tokens = the cached tokens).

A beam group at a queue's front is handed to its counterpart in `beams.py`, as one unit.
"""

from __future__ import annotations

from control_plane.block_manager import SlotReservation
from control_plane.request import Request
from control_plane.scheduler.beams import (
    admit_group,
    hold_beam_steps,
    schedule_group,
    swap_in_group,
)
from control_plane.scheduler.forks import fork, schedule_children
from control_plane.scheduler.step import StepBuilder
from control_plane.scheduler.stop import tokens_left
from control_plane.scheduler.units import group_of, running_seats, seats_asked


def schedule_running(step: StepBuilder) -> None:
    running = step.state.running
    config = step.state.config
    hold = hold_beam_steps(running)
    i = 0
    while i < len(running) and step.tokens > 0:
        req = running[i]
        group = group_of(req)
        if group is not None:
            if not schedule_group(step, group, hold):
                return  # the group was the newest running unit, and is preempted
            i += len(group.beams)
            continue
        left = tokens_left(req, config)
        if left <= 0 or (left > 1 and step.prompt <= 0):
            i += 1
            continue
        num_new = step.cap(left)
        slots = step.reserve_or_preempt(req, num_new)
        if slots is None:
            return  # req was the last running request
        step.add(req, num_new, slots, chunked=num_new < left)
        i += 1


def schedule_swapped(step: StepBuilder) -> None:
    state = step.state
    bm = state.block_manager
    while state.swapped and step.tokens > 0 and _has_seats_for(step, state.swapped[0]):
        req = state.swapped[0]
        group = group_of(req)
        if group is not None:
            if not swap_in_group(step, group):
                return
            continue
        num_new = step.num_new_tokens(req)
        if not bm.can_swap_in(req.req_id, req.num_computed_tokens + num_new):
            return
        moves = bm.swap_in(req.req_id)
        slots = step.reserve(req, num_new)
        assert moves is not None and slots is not None and not slots.copies
        state.swapped.popleft()
        step.swap_in(moves)
        state.start_running(req)
        step.add(req, num_new, slots)


def schedule_waiting(step: StepBuilder) -> None:
    state = step.state
    bm = state.block_manager
    while (
        state.waiting
        and step.tokens > 0
        and step.prompt > 0
        and _has_seats_for(step, state.waiting[0])
    ):
        req = state.waiting[0]
        group = group_of(req)
        if group is not None:
            if not admit_group(step, group):
                return
            continue
        hit = bm.find_cached_prefix(req)
        num_new = step.cap(req.num_tokens_to_compute - hit.num_tokens)
        new_blocks = bm.allocate_slots(req.req_id, hit.num_tokens + num_new, prefix=hit)
        if new_blocks is None:
            return
        state.waiting.popleft()
        req.num_computed_tokens = hit.num_tokens
        state.start_running(req)
        if num_new == 0:  # a fork parent with only its last prompt token left
            if not schedule_children(step, fork(state, req)):
                return
            continue
        step.add(req, num_new, SlotReservation(new_blocks))


def _has_seats_for(step: StepBuilder, req: Request) -> bool:
    state = step.state
    return running_seats(state.running) + seats_asked(req) <= state.config.max_num_seqs
