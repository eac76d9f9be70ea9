"""Parallel sampling (n > 1) by forking.

The parent computes all but its last prompt token, then `update()` (or admission, when nothing
is left to compute) forks it into n children sharing its blocks; the parent leaves every queue
and the worker. The children are RUNNING, new to the worker, and sent in full when first
scheduled; the first write of each into the shared last block copies it (only the last holder
writes in place), so the prompt's full blocks are held once.
"""

from __future__ import annotations

from control_plane.request import Request, RequestStatus
from control_plane.scheduler.state import SchedulerState
from control_plane.scheduler.step import StepBuilder


def fork(state: SchedulerState, parent: Request) -> list[Request]:
    """Replace a fork parent, in the running queue, by its n children sharing its blocks."""
    bm = state.block_manager
    children = [parent.make_child(i) for i in range(parent.sampling.n)]
    for child in children:
        bm.fork(parent.req_id, child.req_id)
        state.requests[child.req_id] = child
        state.unsent.add(child.req_id)
    bm.free(parent.req_id)  # the prompt's blocks are now held once per child
    i = state.running.index(parent)
    state.running[i : i + 1] = children
    if parent.req_id in state.unsent:  # forked at admission
        state.unsent.remove(parent.req_id)
    else:
        state.finished_to_drop.append(parent.req_id)
    parent.status = RequestStatus.FORKED
    del state.requests[parent.req_id]
    state.children[parent.req_id] = [c.req_id for c in children]
    state.counters.forks += 1
    return children


def schedule_children(step: StepBuilder, children: list[Request]) -> bool:
    """Schedule children forked at admission while blocks and budget allow, preempting
    nothing; False if one did not fit (it and the rest wait as RUNNING, unsent)."""
    for child in children:
        if step.tokens == 0:
            return False
        num_new = step.num_new_tokens(child)
        slots = step.reserve(child, num_new)
        if slots is None:
            return False
        step.add(child, num_new, slots)
    return True
