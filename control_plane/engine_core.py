"""One worker's engine core: schedule -> (the transport executes) -> update, with no I/O.

The core holds the scheduler and the plans sent to the worker whose results are not applied
yet, oldest first. Its transport (`EngineLoop` over gRPC, or the simulator's cost model)
asks for plans, executes them in order and hands each result back:

    while (plan := core.next_plan()) is not None:  # up to the async depth
        send(plan)
    result = receive(core.oldest)
    deltas = core.apply(result)

With async scheduling two plans are in flight: the worker finds step n+1 waiting when it
finishes step n, and the control plane applies step n while the worker computes n+1 (see
`Scheduler`). Without it, each plan is made after the previous result.

Step ids are the scheduler's: a new scheduler (the worker lost or restarted) numbers on from
where the last one stopped, so a worker never sees an id twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.block_manager import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from control_plane.scheduler import RequestOutputDelta, Scheduler
from pagedserve.plan import StepPlan, StepResult


@dataclass
class CacheEvents:
    """Prefix-cache changes of one worker since the last drain, folded per block hash.

    replace: the worker's whole cache is restated by `stored` (drop everything else first)."""

    stored: list[bytes]
    removed: list[bytes]
    replace: bool = False


@dataclass
class EngineCounters:
    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens whose K/V the worker computed
    num_generated_tokens: int = 0


class EngineCore:
    """The scheduler, the plans in flight and the prefix-cache events of one worker."""

    def __init__(self, new_scheduler: Callable[[], Scheduler], async_scheduling: bool = True):
        self._new_scheduler = new_scheduler
        self.scheduler = new_scheduler()
        self.async_scheduling = async_scheduling
        self.in_flight: deque[StepPlan] = deque()  # sent to the worker, results not yet applied
        self.counters = EngineCounters()
        self._cache_events: list[BlockEvent] = []

    @property
    def async_depth(self) -> int:
        """Plans in flight at most."""
        return 2 if self.async_scheduling else 1

    @property
    def oldest(self) -> StepPlan:
        """The plan whose result comes next."""
        return self.in_flight[0]

    def next_plan(self) -> StepPlan | None:
        """The next plan to send, in flight from here; None when the async depth is reached or
        there is nothing to send."""
        if len(self.in_flight) >= self.async_depth:
            return None
        scheduler = self.scheduler
        prompt_tokens = scheduler.num_prompt_tokens_scheduled
        plan = scheduler.schedule()
        self.counters.num_prompt_tokens_computed += (
            scheduler.num_prompt_tokens_scheduled - prompt_tokens
        )
        if plan.is_empty:
            return None
        # In flight before it is sent: a request admitted while the transport writes must
        # count this plan ahead of it (a failed send drops every plan in flight).
        self.in_flight.append(plan)
        return plan

    def apply(self, result: StepResult) -> list[RequestOutputDelta]:
        """Applies the oldest plan's result; one delta per sampled token."""
        plan = self.in_flight.popleft()
        self.counters.num_steps += 1
        deltas = self.scheduler.update(plan, result)
        self._cache_events += self.scheduler.block_manager.drain_events()
        return deltas

    def drop_in_flight(self) -> None:
        """Forgets the plans in flight (their results will never be read)."""
        self.in_flight.clear()

    def reset(self, restate_cache: bool = True) -> None:
        """Starts over with an empty scheduler (and block manager), numbering steps on.
        restate_cache: the next drain tells the prefix index the worker holds nothing."""
        step_id = self.scheduler.next_step_id
        self.scheduler = self._new_scheduler()
        self.scheduler.next_step_id = step_id
        if restate_cache:
            self._cache_events = [AllBlocksCleared()]

    # -- prefix-cache events, for the cluster's prefix index ------------------------------------

    def drain_cache_events(self) -> CacheEvents:
        """Folds the block manager's events in order: the last word on each hash wins."""
        events, self._cache_events = self._cache_events, []
        state: dict[bytes, bool] = {}
        replace = False
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                state.clear()
                replace = True
            elif isinstance(ev, BlockStored):
                state[ev.block_hash] = True
            elif isinstance(ev, BlockRemoved):
                state[ev.block_hash] = False
        stored = [h for h, present in state.items() if present]
        removed = [h for h, present in state.items() if not present]
        return CacheEvents(stored, [] if replace else removed, replace)

    def cached_block_hashes(self) -> list[bytes]:
        return self.scheduler.block_manager.cached_prefix_hashes()
