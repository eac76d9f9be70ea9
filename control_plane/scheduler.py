"""Iteration-level scheduling: which requests run in the next step, and how many tokens each.

Pure bookkeeping over `Request`s and a `BlockManager`: `schedule()` returns a `StepPlan`, the
worker executes it, `update(plan, result)` applies the `StepResult`. One step, in order:

    1. running requests, oldest first: each gets min(tokens left, budget left, long-prefill
       threshold) tokens and the blocks to hold them. Out of blocks → preempt the newest
       running request (possibly the one being scheduled) by recompute or swap, and retry.
    2. swapped requests, oldest first, only if step 1 preempted nothing: swap in + schedule.
    3. waiting requests, FIFO, only if nothing was preempted and nothing is left swapped; the
       first that does not fit ends admission (no overtaking).

A plan is only valid after the previous one was applied with `update()`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from control_plane.block_manager import BlockManager
from control_plane.request import Request, RequestStatus
from pagedserve.plan import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    StepPlan,
    StepResult,
)
from pagedserve.sampling_params import InvalidRequestError

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler. long_prefill_token_threshold caps the tokens any one request
    gets per step (None: only the budget caps them), so that long prompts interleave."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    eos_token_ids: tuple[int, ...] = ()
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not isinstance(self.eos_token_ids, tuple) or any(t < 0 for t in self.eos_token_ids):
            raise ValueError(
                f"eos_token_ids must be a tuple of ids >= 0, got {self.eos_token_ids!r}"
            )
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1 or None, got {threshold}")


@dataclass
class RequestOutputDelta:
    """What one step produced for one request.

    logprobs holds the sampled tokens, whose logprob fields are set only when the request
    asked for them. stop_reason is the stop token id when a stop_token_ids entry ended the
    request (None for EOS, length, or not finished).
    """

    req_id: str
    new_token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | None = None


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_kv_usage: float
    cpu_kv_usage: float
    num_steps: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_chunked_prefill_steps: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


@dataclass
class _StepBudget:
    tokens: int
    chunked: bool = False
    preempted: bool = False


@dataclass
class _Counters:
    num_steps: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    chunked_prefill_steps: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


class Scheduler:
    """Continuous batching over one worker's block pool.

    Requests the worker knows are exactly the RUNNING ones. Every other request is sent in
    full (`NewRequestData`) when it starts running; a running request that stops running is
    listed in finished_req_ids: of the plan that preempts it, or of the next plan when it
    finishes or is aborted.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # unfinished requests
        self._finished_to_drop: list[str] = []  # the worker's state for these is stale
        self._next_step_id = 0
        self._unapplied_plan: StepPlan | None = None  # scheduled tokens, not yet updated
        self._counters = _Counters()

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request (WAITING, nothing computed). It may carry output tokens already
        generated elsewhere; generation continues after them.

        Raises InvalidRequestError if it could never finish within max_model_len or the pool.
        """
        if req.req_id in self._requests:
            raise ValueError(f"request {req.req_id} is already scheduled")
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens != 0:
            raise ValueError(f"request {req.req_id} must be WAITING with nothing computed")
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
        self._requests[req.req_id] = req
        self.waiting.append(req)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): blocks are freed at once. Unknown or
        already finished ids are ignored. May be called between schedule() and update()."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            req = self._requests.get(req_id)
            if req is not None:
                self._finish(req, status)

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module docstring). A plan that schedules tokens must
        be applied with update() before the next schedule(); one that schedules none need not.
        """
        if self._unapplied_plan is not None:
            raise RuntimeError(f"step {self._unapplied_plan.step_id} was scheduled, not updated")
        plan = StepPlan(step_id=self._next_step_id, finished_req_ids=self._finished_to_drop)
        self._next_step_id += 1
        self._finished_to_drop = []
        budget = _StepBudget(tokens=self.config.max_num_batched_tokens)
        self._schedule_running(plan, budget)
        if not budget.preempted:
            self._schedule_swapped(plan, budget)
            if not self.swapped:
                self._schedule_waiting(plan, budget)
        if plan.num_scheduled_tokens:
            self._unapplied_plan = plan
            self._counters.num_steps += 1
            self._counters.chunked_prefill_steps += budget.chunked
        return plan

    def _schedule_running(self, plan: StepPlan, budget: _StepBudget) -> None:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            while (
                new_blocks := bm.allocate_slots(req.req_id, req.num_computed_tokens + num_new)
            ) is None:
                victim = self.running.pop()  # the newest; never one scheduled before req
                self._preempt(victim, plan)
                budget.preempted = True
                if victim is req:
                    return  # req was the last running request
            plan.cached_requests.append(CachedRequestData(req.req_id, new_blocks))
            self._take(plan, budget, req, num_new)
            i += 1

    def _schedule_swapped(self, plan: StepPlan, budget: _StepBudget) -> None:
        bm = self.block_manager
        while self.swapped and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = self._num_new_tokens(req, budget)
            num_slots = req.num_computed_tokens + num_new
            if not bm.can_swap_in(req.req_id, num_slots):
                return
            moves = bm.swap_in(req.req_id)
            assert moves is not None and bm.allocate_slots(req.req_id, num_slots) is not None
            self.swapped.popleft()
            plan.swap_in.extend(moves)
            self._counters.swapped_in_blocks += len(moves)
            self._start_running(plan, budget, req, num_new)

    def _schedule_waiting(self, plan: StepPlan, budget: _StepBudget) -> None:
        bm = self.block_manager
        while self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = self._num_new_tokens(req, budget)
            if bm.allocate_slots(req.req_id, req.num_computed_tokens + num_new) is None:
                return
            self.waiting.popleft()
            self._start_running(plan, budget, req, num_new)

    def _num_new_tokens(self, req: Request, budget: _StepBudget) -> int:
        left = req.num_tokens - req.num_computed_tokens
        assert left > 0, f"request {req.req_id} has nothing to compute"
        num_new = min(left, budget.tokens)
        if self.config.long_prefill_token_threshold is not None:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return num_new

    def _take(self, plan: StepPlan, budget: _StepBudget, req: Request, num_new: int) -> None:
        plan.num_scheduled_tokens[req.req_id] = num_new
        budget.tokens -= num_new
        budget.chunked |= req.num_computed_tokens + num_new < req.num_tokens

    def _start_running(
        self, plan: StepPlan, budget: _StepBudget, req: Request, num_new: int
    ) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.new_requests.append(
            NewRequestData(
                req_id=req.req_id,
                prompt_token_ids=list(req.prompt_token_ids),
                output_token_ids=list(req.output_token_ids),
                sampling=req.sampling,
                block_ids=self.block_manager.get_block_ids(req.req_id),
                num_computed_tokens=req.num_computed_tokens,
            )
        )
        self._take(plan, budget, req, num_new)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Take a running request off the worker; it keeps its output tokens."""
        req.num_preemptions += 1
        plan.finished_req_ids.append(req.req_id)
        if self.config.preemption_mode == "swap":
            moves = self.block_manager.swap_out(req.req_id)
            if moves is not None:  # else the CPU pool is full: recompute instead
                plan.swap_out.extend(moves)
                req.status = RequestStatus.SWAPPED
                # Victims go newest-first, so appendleft keeps the queue oldest-first.
                self.swapped.appendleft(req)
                self._counters.preemptions["swap"] += 1
                self._counters.swapped_out_blocks += len(moves)
                return
        self.block_manager.free(req.req_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self._counters.preemptions["recompute"] += 1

    # -- applying a result ------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """Apply the worker's result for `plan`; returns one delta per sampled token.

        Raises ValueError, changing nothing, if the result does not fit the plan: a token for a
        request that was not due to sample, or none for one that was.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id}, plan is {plan.step_id}")
        if plan.num_scheduled_tokens and plan is not self._unapplied_plan:
            raise RuntimeError(f"step {plan.step_id} is not the step awaiting update")
        extra = result.sampled.keys() - plan.num_scheduled_tokens.keys()
        if extra:
            raise ValueError(f"step {plan.step_id}: tokens for unscheduled requests {extra}")
        live: list[tuple[Request, int]] = []
        for req_id, num_new in plan.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished from outside while the step ran
            due = req.num_computed_tokens + num_new == req.num_tokens
            if due != (req_id in result.sampled):
                raise ValueError(
                    f"step {plan.step_id}: request {req_id} "
                    + ("sampled no token" if due else "sampled before its prefill was done")
                )
            live.append((req, num_new))
        self._unapplied_plan = None

        outputs: list[RequestOutputDelta] = []
        for req, num_new in live:
            req.num_computed_tokens += num_new
            sampled = result.sampled.get(req.req_id)
            if sampled is None:
                continue
            req.output_token_ids.append(sampled.token_id)
            delta = RequestOutputDelta(
                req_id=req.req_id,
                new_token_ids=[sampled.token_id],
                logprobs=[sampled],
            )
            status = self._check_stop(req)
            if status is not None:
                self._finish(req, status)
                delta.finished = True
                delta.finish_reason = "length"
                if status is RequestStatus.FINISHED_STOPPED:
                    delta.finish_reason = "stop"
                    delta.stop_reason = (
                        req.stop_reason if isinstance(req.stop_reason, int) else None
                    )
            outputs.append(delta)
        return outputs

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended (stop strings live outside)."""
        sp = req.sampling
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if req.num_output_tokens < sp.min_tokens:
            return None
        last = req.output_token_ids[-1]
        if not sp.ignore_eos and last in self.config.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in sp.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._finished_to_drop.append(req.req_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.swapped.remove(req)
        self.block_manager.free(req.req_id)
        req.status = status
        del self._requests[req.req_id]

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

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_finished(self) -> bool:
        """Finished requests whose worker state the next plan will drop."""
        return bool(self._finished_to_drop)

    @property
    def kv_usage(self) -> float:
        return self.block_manager.gpu_usage

    def stats(self) -> SchedulerStats:
        c = self._counters
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_swapped=self.num_swapped,
            gpu_kv_usage=self.block_manager.gpu_usage,
            cpu_kv_usage=self.block_manager.cpu_usage,
            num_steps=c.num_steps,
            num_preemptions_recompute=c.preemptions["recompute"],
            num_preemptions_swap=c.preemptions["swap"],
            num_chunked_prefill_steps=c.chunked_prefill_steps,
            num_swapped_out_blocks=c.swapped_out_blocks,
            num_swapped_in_blocks=c.swapped_in_blocks,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if queues, statuses and block tables disagree."""
        bm = self.block_manager
        bs = bm.block_size
        queues = (
            (RequestStatus.RUNNING, self.running),
            (RequestStatus.WAITING, self.waiting),
            (RequestStatus.SWAPPED, self.swapped),
        )
        seen: set[str] = set()
        for status, queue in queues:
            for req in queue:
                assert req.req_id not in seen, f"{req.req_id} is queued twice"
                seen.add(req.req_id)
                assert req.status is status, f"{req.req_id} is {req.status} in the {status} queue"
                assert self._requests.get(req.req_id) is req, f"{req.req_id} is not tracked"
                assert 0 <= req.num_computed_tokens < req.num_tokens or (
                    self._unapplied_plan is not None
                ), f"{req.req_id}: computed {req.num_computed_tokens} of {req.num_tokens}"
        assert seen == set(self._requests), "tracked requests missing from every queue"
        assert len(self.running) <= self.config.max_num_seqs, "too many running requests"
        for req in self.running:
            assert not bm.is_swapped(req.req_id), f"running {req.req_id} holds CPU blocks"
            covered = len(bm.get_block_ids(req.req_id)) * bs
            assert covered >= req.num_computed_tokens, f"{req.req_id}: blocks do not cover KV"
        for req in self.swapped:
            assert bm.is_swapped(req.req_id), f"swapped {req.req_id} holds no CPU table"
            covered = len(bm.get_cpu_block_ids(req.req_id)) * bs
            assert covered >= req.num_computed_tokens, f"{req.req_id}: blocks do not cover KV"
        for req in self.waiting:
            assert req.num_computed_tokens == 0, f"waiting {req.req_id} has computed tokens"
        holders = {r.req_id for r in self.running} | {r.req_id for r in self.swapped}
        assert bm.request_ids() <= holders, f"blocks held by {bm.request_ids() - holders}"
        bm.check_integrity()
