"""The scheduler: requests in and out, `schedule()` (the passes of `passes.py` over one
`StepBuilder`), and `update(plan, result)`.

Async scheduling: `schedule()` moves every scheduled request's num_computed_tokens past the
plan's tokens at once, and gives a request whose step will sample a pending output
(`Request.num_pending_outputs`). So the next plan can be made while this one runs: it feeds
the pending token back (the worker holds its id), continues a chunked prefill, and leaves out a
request its pending output will end by length. One plan may be awaiting `update()` when the
next is scheduled; results are applied in plan order. What the overlap changes:

    * a request that ends by EOS, a stop token or a stop string has a step too many in flight;
      its blocks are freed when it ends, the worker computes that step into them before any
      later plan can reuse them (it runs plans in order), and its token is ignored;
    * a request preempted while its step runs keeps that step's token (applied by update());
      a fork parent whose prompt is all in flight is preempted by recompute, not swap, so that
      it forks on readmission instead of resuming with nothing to compute.
"""

from __future__ import annotations

from collections.abc import Iterable

import control_plane.scheduler.views as views
from control_plane.beam import BeamGroup
from control_plane.request import Request, RequestStatus
from control_plane.scheduler.beams import select
from control_plane.scheduler.forks import fork
from control_plane.scheduler.outputs import Backlog, RequestOutputDelta, SchedulerStats
from control_plane.scheduler.passes import schedule_running, schedule_swapped, schedule_waiting
from control_plane.scheduler.state import SchedulerState
from control_plane.scheduler.step import StepBuilder
from control_plane.scheduler.stop import check_stop
from control_plane.scheduler.units import group_of
from pagedserve.plan import SampledToken, StepPlan, StepResult, StepShape
from pagedserve.sampling_params import InvalidRequestError

# Plans that may await update() when schedule() is called: the step running, none beyond it.
MAX_PLANS_AWAITING_UPDATE = 1


class Scheduler(SchedulerState):
    """Continuous batching over one worker's block pool (what it holds: `SchedulerState`)."""

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request (WAITING, nothing computed). It may carry output tokens already
        generated elsewhere; generation continues after them. A request with n > 1 is forked
        here later; a parallel-sampling child (parent_id set, n == 1, its own seed) may also be
        added by itself, and then counts among its parent's children.

        Raises InvalidRequestError if it could never finish within max_model_len or the pool.
        """
        if req.req_id in self.requests or req.req_id in self.children:
            raise ValueError(f"request {req.req_id} is already scheduled")
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens != 0:
            raise ValueError(f"request {req.req_id} must be WAITING with nothing computed")
        if req.is_fork_parent and req.output_token_ids:
            raise ValueError(f"request {req.req_id}: n > 1 with output tokens; add the children")
        seats = req.sampling.beam_width or req.sampling.n
        if req.sampling.beam_width > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"request {req.req_id}: beam_width = {req.sampling.beam_width} exceeds "
                f"max_num_batched_tokens {self.config.max_num_batched_tokens}: a beam search "
                "computes one token per beam in each step"
            )
        if seats > self.config.max_num_seqs:
            what = "beam_width" if req.sampling.beam_width else "n"
            raise InvalidRequestError(
                f"request {req.req_id}: {what} = {seats} exceeds max_num_seqs "
                f"{self.config.max_num_seqs}"
            )
        max_len = self.config.max_model_len
        if req.num_tokens >= max_len:
            raise InvalidRequestError(
                f"request {req.req_id}: {req.num_tokens} tokens leave no room to generate "
                f"within max_model_len {max_len}"
            )
        if req.num_output_tokens >= req.sampling.max_tokens:
            raise InvalidRequestError(f"request {req.req_id}: max_tokens already reached")
        # The last sampled token is never fed back, so it needs no slot.
        final_len = min(req.num_prompt_tokens + req.sampling.max_tokens, max_len)
        bm = self.block_manager
        if bm.num_blocks_for(final_len - 1) > bm.num_gpu_blocks:
            raise InvalidRequestError(
                f"request {req.req_id}: {final_len} tokens need more KV blocks than the "
                f"worker has ({bm.num_gpu_blocks} of {bm.block_size} tokens)"
            )
        group = group_of(req)
        if req.sampling.beam_width and group is None:
            group = BeamGroup.start(req, self.config.eos_token_ids, max_len)
            req = group.beams[0]
        if group is not None:
            needed = group.worst_case_blocks(bm.block_size)
            if needed > bm.num_gpu_blocks:
                raise InvalidRequestError(
                    f"request {req.parent_id}: beam search of width {group.width} can hold "
                    f"{needed} KV blocks at once, more than the worker has "
                    f"({bm.num_gpu_blocks} of {bm.block_size} tokens)"
                )
        self.requests[req.req_id] = req
        self.waiting.append(req)
        if req.parent_id is not None:  # a child added by itself, e.g. moved from another worker
            self.children.setdefault(req.parent_id, []).append(req.req_id)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): blocks are freed at once. A forked
        parent's id ends all its unfinished children; a child's id ends that child only.
        Unknown or already finished ids are ignored. May be called between schedule() and
        update()."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            for req in self.live_requests(req_id):
                self.finish(req, status)

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id (a forked parent is not one: see
        live_requests)."""
        return self.requests.get(req_id)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan (see `passes.py` for its order). A plan that schedules tokens
        must be applied with update(), in order; one more may be scheduled before that (async
        scheduling). A plan that schedules none needs no update().
        """
        if len(self.in_flight) > MAX_PLANS_AWAITING_UPDATE:
            steps = [f.plan.step_id for f in self.in_flight]
            raise RuntimeError(f"steps {steps} were scheduled, not updated")
        plan = StepPlan(step_id=self.next_step_id, finished_req_ids=self.finished_to_drop)
        self.next_step_id += 1
        self.finished_to_drop = []
        step = StepBuilder(self, plan)
        schedule_running(step)
        if not step.preempted:
            schedule_swapped(step)
            if not self.swapped:
                schedule_waiting(step)
        if plan.num_scheduled_tokens:
            self.in_flight.append(step.advance())
            self.counters.num_steps += 1
            self.counters.chunked_prefill_steps += step.chunked
        used = self.block_manager.num_gpu_blocks - self.block_manager.num_free_gpu_blocks
        self.counters.peak_used_gpu_blocks = max(self.counters.peak_used_gpu_blocks, used)
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """Apply the worker's result for `plan`; returns one delta per sampled token.

        Raises ValueError, changing nothing, if the result does not fit the plan: a token for a
        request that was not due to sample, or none for one that was.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id}, plan is {plan.step_id}")
        if plan.num_scheduled_tokens and (not self.in_flight or plan is not self.in_flight[0].plan):
            raise RuntimeError(f"step {plan.step_id} is not the step awaiting update")
        extra = result.sampled.keys() - plan.num_scheduled_tokens.keys()
        if extra:
            raise ValueError(f"step {plan.step_id}: tokens for unscheduled requests {extra}")
        if not plan.num_scheduled_tokens:
            return []
        in_flight = self.in_flight[0]
        live: list[tuple[Request, int, bool]] = []
        unfinished, stepped, sampling = self.requests, in_flight.requests, in_flight.sampling
        for req_id, num_new in plan.num_scheduled_tokens.items():
            req = stepped[req_id]
            if unfinished.get(req_id) is not req:
                continue  # finished (or forked) from outside while the step ran
            due = req_id in sampling
            if due != (req_id in result.sampled):
                raise ValueError(
                    f"step {plan.step_id}: request {req_id} "
                    + ("sampled no token" if due else "sampled before its prefill was done")
                )
            live.append((req, num_new, due))
        self.in_flight.popleft()

        outputs: list[RequestOutputDelta] = []
        groups: dict[BeamGroup, dict[str, SampledToken]] = {}
        cache_full_blocks = self.block_manager.cache_full_blocks
        self.counters.computed_tokens += sum(num_new for _, num_new, _ in live)
        for req, _, due in live:
            if req.status is RequestStatus.RUNNING:  # else preempted while the step ran
                cache_full_blocks(req)
                if req.is_fork_parent and req.num_computed_tokens == req.num_tokens_to_compute:
                    fork(self, req)
                    continue
            if not due:
                continue
            req.num_pending_outputs -= 1
            sampled = result.sampled[req.req_id]
            group = group_of(req)
            if group is not None:
                groups.setdefault(group, {})[req.req_id] = sampled
                continue
            outputs.append(self._append_token(req, sampled))
        for group, candidates in groups.items():
            outputs += select(self, group, [candidates[i] for i in group.ids])
        return outputs

    def _append_token(self, req: Request, sampled: SampledToken) -> RequestOutputDelta:
        """Appends a sampled token to a request outside beam search; ends it if it stops."""
        req.output_token_ids.append(sampled.token_id)
        delta = RequestOutputDelta(
            req_id=req.req_id,
            new_token_ids=[sampled.token_id],
            logprobs=[sampled],
            parent_id=req.parent_id,
            index=req.index,
        )
        stop = check_stop(req, self.config)
        if stop is not None:
            if stop.stop_token_id is not None:
                req.stop_reason = stop.stop_token_id
            self.finish(req, stop.status)
            delta.finished = True
            delta.all_finished = not self.live_requests(req.parent_id or req.req_id)
            delta.finish_reason = "length"
            if stop.status is RequestStatus.FINISHED_STOPPED:
                delta.finish_reason = "stop"
                delta.stop_reason = req.stop_reason if isinstance(req.stop_reason, int) else None
        return delta

    # -- state ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def backlog(self) -> Backlog:
        """The work ahead of a request added now (FCFS: everything already here)."""
        return views.backlog(self)

    def sampling_rows(self, plan: StepPlan) -> frozenset[str]:
        """The requests of a plan awaiting update() that will sample a token in it (what its
        StepResult must carry)."""
        return views.sampling_rows(self, plan)

    def plan_shape(self, plan: StepPlan) -> StepShape:
        """The shape of a plan just made by schedule() (see `StepShape`)."""
        return views.plan_shape(self, plan)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_finished(self) -> bool:
        """Finished requests whose worker state the next plan will drop."""
        return bool(self.finished_to_drop)

    @property
    def num_prompt_tokens_scheduled(self) -> int:
        """Prompt tokens whose K/V the worker was told to compute, all plans together."""
        return self.counters.prompt_tokens

    @property
    def kv_usage(self) -> float:
        return self.block_manager.gpu_usage

    def stats(self) -> SchedulerStats:
        return views.stats(self)

    def check_integrity(self) -> None:
        """Raise AssertionError if queues, statuses and block tables disagree."""
        views.check_integrity(self)
