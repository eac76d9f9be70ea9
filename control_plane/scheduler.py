"""Iteration-level scheduling: which requests run in the next step, and how many tokens each.

Pure bookkeeping over `Request`s and a `BlockManager`: `schedule()` returns a `StepPlan`, the
worker executes it, `update(plan, result)` applies the `StepResult`. One step, in order:

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

Parallel sampling (n > 1): the parent computes all but its last prompt token, then `update()`
(or admission, when nothing is left to compute) forks it into n children sharing its blocks;
the parent leaves every queue and the worker. The children are RUNNING, new to the worker, and
sent in full when first scheduled; the first write of each into the shared last block copies
it (only the last holder writes in place), so the prompt's full blocks are held once.

Copy-on-write and the worker: the worker learns a replaced block from a full table
(`NewRequestData`), or, for a beam, from `CachedRequestData.copied`. Outside beam search a copy
is only ever needed on a request's first schedule after a fork, so a copy for a request the
worker already knows is a bug, and `schedule()` asserts against it.

Beam search (`control_plane/beam.py`): a group's beams sit next to each other in one queue and
move as one unit: scheduled together (every beam reaches its last token in the same step, or
a step catches every beam up to one short of it), preempted together (swapped with their
shared blocks still shared, or recomputed, when the prefix cache finds their common blocks
again), and selected from together in `update()`.

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

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from control_plane.beam import BeamGroup, Hypothesis, beam_request_id
from control_plane.block_manager import BlockManager, PrefixCacheStats, SlotReservation
from control_plane.request import Request, RequestStatus
from pagedserve.plan import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    StepPlan,
    StepResult,
    StepShape,
)
from pagedserve.sampling_params import InvalidRequestError

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler. long_prefill_token_threshold caps the tokens any one request
    gets per step (None: only the budget caps them), so that long prompts interleave.
    max_prefill_tokens_with_decodes caps the prompt tokens of a step that also carries
    decodes (None: only the budget caps them): a step's length is every running stream's gap
    between two tokens, and the prompt chunks make most of it, while a step with no decode
    in it still takes the whole budget for the first tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    eos_token_ids: tuple[int, ...] = ()
    long_prefill_token_threshold: int | None = None
    max_prefill_tokens_with_decodes: int | None = None

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
        for name in ("long_prefill_token_threshold", "max_prefill_tokens_with_decodes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


@dataclass(slots=True)
class RequestOutputDelta:
    """What one step produced for one request.

    logprobs holds the sampled tokens, whose logprob fields are set only when the request
    asked for them. stop_reason is the stop token id when a stop_token_ids entry ended the
    request (None for EOS, length, or not finished).

    For a parallel-sampling child, parent_id is the client's request id and index the child's
    place in it. all_finished is True on the delta that leaves nothing unfinished for the
    client's request: the request itself finished, or the last live child of parent_id did.
    """

    req_id: str
    new_token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | None = None
    parent_id: str | None = None
    index: int = 0
    all_finished: bool = False
    sequence_score: float | None = None  # beam search: the returned sequence's score


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
    num_computed_tokens: int = 0  # tokens whose K/V the worker computed, all steps together
    num_forks: int = 0
    num_copied_blocks: int = 0
    num_used_gpu_blocks: int = 0
    num_gpu_block_refs: int = 0  # used blocks as they would be without sharing
    peak_used_gpu_blocks: int = 0  # most GPU blocks in use at once, after any schedule()
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


@dataclass(frozen=True, slots=True)
class Backlog:
    """What a request added now finds ahead of it: the work that admission's queue-delay
    estimate prices (`control_plane.admission`)."""

    rows: int  # running requests: at least one token each in every step
    prefill_tokens: int  # tokens to compute before they decode: waiting, swapped, mid-prefill
    seats: int  # max_num_seqs seats held or asked for by every unfinished request
    blocks_needed: int  # KV blocks the waiting requests will take when they start
    free_blocks: int


@dataclass(frozen=True)
class _InFlight:
    """A plan awaiting update(): the requests it scheduled, and the ids of those due to sample."""

    plan: StepPlan
    requests: dict[str, Request]
    sampling: frozenset[str]


# Plans that may await update() when schedule() is called: the step running, none beyond it.
MAX_PLANS_AWAITING_UPDATE = 1


@dataclass
class _StepBudget:
    tokens: int
    prompt: int  # of `tokens`, what chunks of more than one token may still take
    chunked: bool = False
    preempted: bool = False


@dataclass
class _Counters:
    num_steps: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    chunked_prefill_steps: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    forks: int = 0
    copied_blocks: int = 0
    peak_used_gpu_blocks: int = 0


class Scheduler:
    """Continuous batching over one worker's block pool.

    Requests the worker knows are exactly the RUNNING ones except forked children not yet
    scheduled (`_unsent`). Every other request is sent in full (`NewRequestData`) when it is
    next scheduled; a request the worker knows that stops running is listed in
    finished_req_ids: of the plan that preempts it, or of the next plan when it finishes, is
    aborted or forks. A fork parent takes n of the max_num_seqs seats, as its children will.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # unfinished requests
        self._unsent: set[str] = set()  # running, but new to the worker
        self._children: dict[str, list[str]] = {}  # forked parent -> its unfinished children
        self._finished_to_drop: list[str] = []  # the worker's state for these is stale
        self._next_step_id = 0
        self._in_flight: deque[_InFlight] = deque()  # plans with tokens, not yet updated
        self._counters = _Counters()

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request (WAITING, nothing computed). It may carry output tokens already
        generated elsewhere; generation continues after them. A request with n > 1 is forked
        here later; a parallel-sampling child (parent_id set, n == 1, its own seed) may also be
        added by itself, and then counts among its parent's children.

        Raises InvalidRequestError if it could never finish within max_model_len or the pool.
        """
        if req.req_id in self._requests or req.req_id in self._children:
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
        if req.sampling.beam_width and req.beam is None:
            req = BeamGroup.start(req, self.config.eos_token_ids, max_len).beams[0]
        if req.beam is not None:
            needed = req.beam.worst_case_blocks(bm.block_size)
            if needed > bm.num_gpu_blocks:
                raise InvalidRequestError(
                    f"request {req.parent_id}: beam search of width {req.beam.width} can hold "
                    f"{needed} KV blocks at once, more than the worker has "
                    f"({bm.num_gpu_blocks} of {bm.block_size} tokens)"
                )
        self._requests[req.req_id] = req
        self.waiting.append(req)
        if req.parent_id is not None:  # a child added by itself, e.g. moved from another worker
            self._children.setdefault(req.parent_id, []).append(req.req_id)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): blocks are freed at once. A forked
        parent's id ends all its unfinished children; a child's id ends that child only.
        Unknown or already finished ids are ignored. May be called between schedule() and
        update()."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            for req in self.live_requests(req_id):
                self._finish(req, status)

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id (a forked parent is not one: see
        live_requests)."""
        return self._requests.get(req_id)

    def live_requests(self, req_id: str) -> list[Request]:
        """The unfinished requests answering for a client's request id: the request itself,
        or a forked parent's unfinished children in index order; [] when all finished."""
        req = self._requests.get(req_id)
        if req is not None:
            return [req]
        return [self._requests[c] for c in self._children.get(req_id, ())]

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module docstring). A plan that schedules tokens must
        be applied with update(), in order; one more may be scheduled before that (async
        scheduling). A plan that schedules none needs no update().
        """
        if len(self._in_flight) > MAX_PLANS_AWAITING_UPDATE:
            steps = [f.plan.step_id for f in self._in_flight]
            raise RuntimeError(f"steps {steps} were scheduled, not updated")
        plan = StepPlan(step_id=self._next_step_id, finished_req_ids=self._finished_to_drop)
        self._next_step_id += 1
        self._finished_to_drop = []
        tokens = self.config.max_num_batched_tokens
        budget = _StepBudget(tokens=tokens, prompt=tokens)
        cap = self.config.max_prefill_tokens_with_decodes
        if cap is not None and cap < tokens and self._any_decoding():
            budget.prompt = cap
        self._schedule_running(plan, budget)
        if not budget.preempted:
            self._schedule_swapped(plan, budget)
            if not self.swapped:
                self._schedule_waiting(plan, budget)
        if plan.num_scheduled_tokens:
            self._in_flight.append(self._advance(plan))
            self._counters.num_steps += 1
            self._counters.chunked_prefill_steps += budget.chunked
        used = self.block_manager.num_gpu_blocks - self.block_manager.num_free_gpu_blocks
        self._counters.peak_used_gpu_blocks = max(self._counters.peak_used_gpu_blocks, used)
        return plan

    def _advance(self, plan: StepPlan) -> _InFlight:
        """Moves each scheduled request past this plan's tokens; one that reaches its last token
        gets a pending output."""
        requests: dict[str, Request] = {}
        sampling: set[str] = set()
        live = self._requests
        prompt_tokens = 0
        for req_id, num_new in plan.num_scheduled_tokens.items():
            req = requests[req_id] = live[req_id]
            start = req.num_computed_tokens
            end = req.num_computed_tokens = start + num_new
            num_prompt = len(req.prompt_token_ids)
            if start < num_prompt:
                prompt_tokens += min(end, num_prompt) - start
            if (
                not req.is_fork_parent
                and end == num_prompt + len(req.output_token_ids) + req.num_pending_outputs
            ):  # its last token (num_tokens_to_compute): it samples
                req.num_pending_outputs += 1
                sampling.add(req_id)
        self._counters.prompt_tokens += prompt_tokens
        return _InFlight(plan, requests, frozenset(sampling))

    def _tokens_left(self, req: Request) -> int:
        """Tokens a running request may compute now: 0 when the rest is in flight (a fork
        parent's prompt) or its pending outputs will end it by length."""
        left = req.num_tokens_to_compute - req.num_computed_tokens
        pending = req.num_pending_outputs
        if left <= 0 or not pending:
            return left
        num_output = len(req.output_token_ids) + pending
        if (
            num_output < req.sampling.max_tokens
            and len(req.prompt_token_ids) + num_output < self.config.max_model_len
        ):
            return left
        return 0

    def _any_decoding(self) -> bool:
        """Whether a running request computes its one next token in the step being made (the
        oldest running one, most often)."""
        return any(self._tokens_left(r) == 1 for r in self.running)

    def _schedule_running(self, plan: StepPlan, budget: _StepBudget) -> None:
        hold = self._hold_beam_steps()
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            if req.beam is not None:
                if not self._schedule_group(plan, budget, req.beam, hold):
                    return  # the group was the newest running unit, and is preempted
                i += len(req.beam.beams)
                continue
            left = self._tokens_left(req)
            if left <= 0 or (left > 1 and budget.prompt <= 0):
                i += 1
                continue
            num_new = self._cap(left, budget)
            slots = self._reserve_or_preempt(plan, budget, req, num_new)
            if slots is None:
                return  # req was the last running request
            self._schedule_request(plan, budget, req, num_new, slots, chunked=num_new < left)
            i += 1

    def _reserve_or_preempt(
        self, plan: StepPlan, budget: _StepBudget, req: Request, num_new: int
    ) -> SlotReservation | None:
        """Reserves req's slots, preempting the newest running units until they fit; None
        when req itself (or its beam group) was preempted."""
        start = req.num_computed_tokens
        reserve = self.block_manager.reserve_slots
        while (slots := reserve(req.req_id, start, start + num_new)) is None:
            victims = self._pop_newest()  # never one scheduled before req
            self._preempt(victims, plan)
            budget.preempted = True
            if req in victims:
                return None
        return slots

    def _pop_newest(self) -> list[Request]:
        """Takes the newest running unit off the running queue: a request, or a whole beam
        group (its beams are the last ones)."""
        victim = self.running.pop()
        if victim.beam is None:
            return [victim]
        n = len(victim.beam.beams)
        units = self.running[len(self.running) - n + 1 :]
        del self.running[len(self.running) - n + 1 :]
        return [*units, victim]

    def _group_tokens(self, group: BeamGroup, budget: _StepBudget) -> list[int] | None:
        """Tokens per beam this step: every beam to its last token when all of them fit
        (the group's step: each beam then returns candidates), else each beam's prefill up to
        one short of its last token; None when nothing fits."""
        gaps = [b.num_tokens - b.num_computed_tokens for b in group.beams]
        cap = self.config.long_prefill_token_threshold
        if not group.unforked and sum(gaps) <= budget.tokens and (cap is None or max(gaps) <= cap):
            return gaps
        nums: list[int] = []
        left = budget.tokens
        for beam, gap in zip(group.beams, gaps, strict=True):
            n = 0 if beam.req_id in group.unforked else min(gap - 1, left, cap or gap)
            nums.append(n)
            left -= n
        return nums if any(nums) else None

    def _hold_beam_steps(self) -> bool:
        """Whether beam groups ready for their next step wait for the plan after this one:
        when at least as many beams have a step in flight. A group's step must wait for its
        selection, so with async scheduling groups would otherwise settle into cohorts that
        take turns, each step computing only part of the beams; held, they merge into one
        cohort and every step computes all of them."""
        in_flight = ready = 0
        for r in self.running:
            if r.beam is not None:
                if r.num_pending_outputs:
                    in_flight += 1
                elif r.num_tokens - r.num_computed_tokens == 1:
                    ready += 1
        return 0 < ready <= in_flight

    def _schedule_group(
        self, plan: StepPlan, budget: _StepBudget, group: BeamGroup, hold: bool = False
    ) -> bool:
        """Schedules a running beam group as one unit; False if it was preempted. Blocks for
        every beam are made free first (preempting newer units), then reserved: a reservation
        that copies a shared block replaces it in the table at once, so one that could not be
        completed would leave a copy the plan never makes."""
        if any(b.num_pending_outputs for b in group.beams):
            return True  # its step is in flight: the next one waits for the selection
        if hold and all(b.num_tokens - b.num_computed_tokens == 1 for b in group.beams):
            return True
        bm = self.block_manager
        if group.unforked:
            self._fork_recomputed_beams(group)
        nums = self._group_tokens(group, budget)
        if nums is None:
            return True
        ranges = [
            (b.req_id, b.num_computed_tokens, b.num_computed_tokens + n)
            for b, n in zip(group.beams, nums, strict=True)
            if n
        ]
        while bm.num_blocks_to_reserve(ranges) > bm.num_free_gpu_blocks:
            victims = self._pop_newest()
            self._preempt(victims, plan)
            budget.preempted = True
            if group.beams[0] in victims:
                return False
        reserved: list[SlotReservation | None] = []
        for beam, n in zip(group.beams, nums, strict=True):
            slots = self._reserve(beam, n) if n else None
            assert slots is not None or not n, f"{beam.req_id}: blocks counted, not there"
            reserved.append(slots)
        self._schedule_beams(plan, budget, group, nums, reserved)
        return True

    def _fork_recomputed_beams(self, group: BeamGroup) -> None:
        """Recomputed beams take the blocks they share with the first beam once it has
        computed them (or a plan in flight does: the worker runs plans in order)."""
        bm = self.block_manager
        first = group.beams[0]
        for beam in group.beams[1:]:
            if beam.req_id not in group.unforked:
                continue
            shared = group.shared_prefix(beam, bm.block_size)
            if first.num_computed_tokens >= shared:
                bm.fork(first.req_id, beam.req_id, shared // bm.block_size)
                beam.num_computed_tokens = shared
                group.unforked.discard(beam.req_id)

    def _schedule_beams(
        self,
        plan: StepPlan,
        budget: _StepBudget,
        group: BeamGroup,
        nums: list[int],
        reserved: list[SlotReservation | None],
    ) -> None:
        plan.beam_forks.extend(group.pending_forks)
        group.pending_forks = []
        for beam, n, slots in zip(group.beams, nums, reserved, strict=True):
            if n:
                assert slots is not None
                self._schedule_request(plan, budget, beam, n, slots)

    def _schedule_swapped(self, plan: StepPlan, budget: _StepBudget) -> None:
        bm = self.block_manager
        while self.swapped and budget.tokens > 0 and self._has_seats_for(self.swapped[0]):
            req = self.swapped[0]
            if req.beam is not None:
                if not self._swap_in_group(plan, budget, req.beam):
                    return
                continue
            num_new = self._num_new_tokens(req, budget)
            if not bm.can_swap_in(req.req_id, req.num_computed_tokens + num_new):
                return
            moves = bm.swap_in(req.req_id)
            slots = self._reserve(req, num_new)
            assert moves is not None and slots is not None and not slots.copies
            self.swapped.popleft()
            plan.swap_in.extend(moves)
            self._counters.swapped_in_blocks += len(moves)
            self._start_running(req)
            self._schedule_request(plan, budget, req, num_new, slots)

    def _swap_in_group(self, plan: StepPlan, budget: _StepBudget, group: BeamGroup) -> bool:
        """Resumes a swapped beam group, its shared blocks still shared; False if it does
        not fit this step."""
        bm = self.block_manager
        nums = self._group_tokens(group, budget)
        if nums is None:
            return False
        ids = group.ids
        ranges = [
            (b.req_id, b.num_computed_tokens, b.num_computed_tokens + n)
            for b, n in zip(group.beams, nums, strict=True)
            if n
        ]
        # Sharing survives the swap, so the copies and new blocks are counted on the CPU side.
        if not bm.can_swap_in(ids, extra_blocks=bm.num_blocks_to_reserve(ranges)):
            return False
        moves = bm.swap_in(ids)
        assert moves is not None
        plan.swap_in.extend(moves)
        self._counters.swapped_in_blocks += len(moves)
        self._start_group(plan, budget, group, nums, self.swapped)
        return True

    def _admit_group(self, plan: StepPlan, budget: _StepBudget, group: BeamGroup) -> bool:
        """Admits a waiting beam group, each beam from its longest cached prefix, the beams
        of a recomputed group forking what they share with the first one; False, changing
        nothing, if it does not fit this step."""
        bm = self.block_manager
        for beam in group.beams:
            if beam.req_id not in group.unforked:
                hit = bm.find_cached_prefix(beam)
                bm.allocate_slots(beam.req_id, hit.num_tokens, prefix=hit)
                beam.num_computed_tokens = hit.num_tokens
        self._fork_recomputed_beams(group)
        nums = self._group_tokens(group, budget)
        ranges = [
            (b.req_id, b.num_computed_tokens, b.num_computed_tokens + n)
            for b, n in zip(group.beams, nums or [], strict=True)
            if n
        ]
        if nums is None or bm.num_blocks_to_reserve(ranges) > bm.num_free_gpu_blocks:
            for beam in group.beams:
                bm.free(beam.req_id)
                beam.num_computed_tokens = 0
            if len(group.beams) > 1:
                group.recompute()
            return False
        self._start_group(plan, budget, group, nums, self.waiting)
        return True

    def _start_group(
        self,
        plan: StepPlan,
        budget: _StepBudget,
        group: BeamGroup,
        nums: list[int],
        queue: deque[Request],
    ) -> None:
        """Moves a group from the front of `queue` to the running ones and schedules it; its
        blocks were counted free."""
        reserved: list[SlotReservation | None] = []
        for beam, n in zip(group.beams, nums, strict=True):
            assert queue.popleft() is beam
            self._start_running(beam)
            slots = self._reserve(beam, n) if n else None
            assert slots is not None or not n
            reserved.append(slots)
        self._schedule_beams(plan, budget, group, nums, reserved)

    def _schedule_waiting(self, plan: StepPlan, budget: _StepBudget) -> None:
        bm = self.block_manager
        while (
            self.waiting
            and budget.tokens > 0
            and budget.prompt > 0
            and self._has_seats_for(self.waiting[0])
        ):
            req = self.waiting[0]
            if req.beam is not None:
                if not self._admit_group(plan, budget, req.beam):
                    return
                continue
            hit = bm.find_cached_prefix(req)
            num_new = self._cap(req.num_tokens_to_compute - hit.num_tokens, budget)
            new_blocks = bm.allocate_slots(req.req_id, hit.num_tokens + num_new, prefix=hit)
            if new_blocks is None:
                return
            self.waiting.popleft()
            req.num_computed_tokens = hit.num_tokens
            self._start_running(req)
            if num_new == 0:  # a fork parent with only its last prompt token left
                if not self._schedule_children(plan, budget, self._fork(req)):
                    return
                continue
            self._schedule_request(plan, budget, req, num_new, SlotReservation(new_blocks))

    def _schedule_children(
        self, plan: StepPlan, budget: _StepBudget, children: list[Request]
    ) -> bool:
        """Schedule children forked at admission while blocks and budget allow, preempting
        nothing; False if one did not fit (it and the rest wait as RUNNING, unsent)."""
        for child in children:
            if budget.tokens == 0:
                return False
            num_new = self._num_new_tokens(child, budget)
            slots = self._reserve(child, num_new)
            if slots is None:
                return False
            self._schedule_request(plan, budget, child, num_new, slots)
        return True

    def _has_seats_for(self, req: Request) -> bool:
        return self._running_seats() + _seats_asked(req) <= self.config.max_num_seqs

    def _running_seats(self) -> int:
        """Seats the running requests hold: a fork parent n (its children's), a beam group
        its width, whether it has widened to width beams yet or not."""
        return sum(
            r.sampling.n if r.beam is None else (1 if len(r.beam.beams) > 1 else r.beam.width)
            for r in self.running
        )

    def _num_new_tokens(self, req: Request, budget: _StepBudget) -> int:
        left = req.num_tokens_to_compute - req.num_computed_tokens
        assert left > 0, f"request {req.req_id} has nothing to compute"
        return self._cap(left, budget)

    def _cap(self, num_tokens: int, budget: _StepBudget) -> int:
        """Tokens a request with num_tokens to compute gets: a chunk of more than one token
        within the prompt budget too (at least one token while that has any left)."""
        num_new = num_tokens if num_tokens < budget.tokens else budget.tokens
        if num_new > 1 and num_new > budget.prompt:
            num_new = max(1, budget.prompt)
        cap = self.config.long_prefill_token_threshold
        return num_new if cap is None or num_new <= cap else cap

    def _reserve(self, req: Request, num_new: int) -> SlotReservation | None:
        start = req.num_computed_tokens
        return self.block_manager.reserve_slots(req.req_id, start, start + num_new)

    def _start_running(self, req: Request) -> None:
        """A waiting or swapped request joins the running ones; the worker does not know it."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._unsent.add(req.req_id)

    def _schedule_request(
        self,
        plan: StepPlan,
        budget: _StepBudget,
        req: Request,
        num_new: int,
        slots: SlotReservation,
        chunked: bool | None = None,
    ) -> None:
        """Put a running request with its reserved slots into the plan; `chunked`: whether
        num_new falls short of its last token, when the caller knows."""
        if slots.copies:
            plan.copy_blocks.extend(slots.copies)
            self._counters.copied_blocks += len(slots.copies)
        if req.req_id in self._unsent:
            self._unsent.remove(req.req_id)
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
        else:
            # Outside beam search a copy only happens on a request's first schedule after a
            # fork, when the worker gets its whole table.
            assert not slots.copies or req.beam is not None, (
                f"{req.req_id}: copy-on-write in a table the worker holds"
            )
            if slots.new_block_ids or slots.copies:  # a table that did not change needs none
                plan.cached_requests.append(
                    CachedRequestData(req.req_id, slots.new_block_ids, slots.copies)
                )
        plan.num_scheduled_tokens[req.req_id] = num_new
        budget.tokens -= num_new
        if num_new > 1:
            budget.prompt -= num_new
        if chunked is None:
            chunked = req.num_computed_tokens + num_new < req.num_tokens_to_compute
        budget.chunked |= chunked

    def _fork(self, parent: Request) -> list[Request]:
        """Replace a fork parent, in the running queue, by its n children sharing its blocks."""
        bm = self.block_manager
        children = [parent.make_child(i) for i in range(parent.sampling.n)]
        for child in children:
            bm.fork(parent.req_id, child.req_id)
            self._requests[child.req_id] = child
            self._unsent.add(child.req_id)
        bm.free(parent.req_id)  # the prompt's blocks are now held once per child
        i = self.running.index(parent)
        self.running[i : i + 1] = children
        if parent.req_id in self._unsent:  # forked at admission
            self._unsent.remove(parent.req_id)
        else:
            self._finished_to_drop.append(parent.req_id)
        parent.status = RequestStatus.FORKED
        del self._requests[parent.req_id]
        self._children[parent.req_id] = [c.req_id for c in children]
        self._counters.forks += 1
        return children

    def _preempt(self, unit: list[Request], plan: StepPlan) -> None:
        """Take a running request, or a beam group, off the worker; each keeps its output
        tokens."""
        for req in unit:
            req.num_preemptions += 1
            if req.req_id in self._unsent:
                self._unsent.remove(req.req_id)
            else:
                plan.finished_req_ids.append(req.req_id)
        req = unit[0]
        if req.beam is not None:
            req.beam.pending_forks = []  # the beams are sent in full when they resume
        # A fork parent with all its prompt in flight forks when readmitted (see the module
        # docstring): swapped, it would resume with nothing to compute. A beam group whose
        # beams have not all forked from the first again recomputes.
        parent_done = req.is_fork_parent and req.num_computed_tokens == req.num_tokens_to_compute
        regrowing = req.beam is not None and bool(req.beam.unforked)
        if self.config.preemption_mode == "swap" and not parent_done and not regrowing:
            moves = self.block_manager.swap_out([r.req_id for r in unit])
            if moves is not None:  # else the CPU pool is full: recompute instead
                plan.swap_out.extend(moves)
                for r in reversed(unit):
                    r.status = RequestStatus.SWAPPED
                    # Victims go newest-first, so appendleft keeps the queue oldest-first.
                    self.swapped.appendleft(r)
                self._counters.preemptions["swap"] += 1
                self._counters.swapped_out_blocks += len(moves)
                return
        for r in reversed(unit):
            self.block_manager.free(r.req_id)
            r.num_computed_tokens = 0
            r.status = RequestStatus.WAITING
            self.waiting.appendleft(r)
        if req.beam is not None:
            req.beam.recompute()
        self._counters.preemptions["recompute"] += 1

    # -- applying a result ------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """Apply the worker's result for `plan`; returns one delta per sampled token.

        Raises ValueError, changing nothing, if the result does not fit the plan: a token for a
        request that was not due to sample, or none for one that was.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id}, plan is {plan.step_id}")
        if plan.num_scheduled_tokens and (
            not self._in_flight or plan is not self._in_flight[0].plan
        ):
            raise RuntimeError(f"step {plan.step_id} is not the step awaiting update")
        extra = result.sampled.keys() - plan.num_scheduled_tokens.keys()
        if extra:
            raise ValueError(f"step {plan.step_id}: tokens for unscheduled requests {extra}")
        if not plan.num_scheduled_tokens:
            return []
        in_flight = self._in_flight[0]
        live: list[tuple[Request, int, bool]] = []
        unfinished, stepped, sampling = self._requests, in_flight.requests, in_flight.sampling
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
        self._in_flight.popleft()

        outputs: list[RequestOutputDelta] = []
        groups: dict[BeamGroup, dict[str, SampledToken]] = {}
        cache_full_blocks = self.block_manager.cache_full_blocks
        self._counters.computed_tokens += sum(num_new for _, num_new, _ in live)
        for req, _, due in live:
            if req.status is RequestStatus.RUNNING:  # else preempted while the step ran
                cache_full_blocks(req)
                if req.is_fork_parent and req.num_computed_tokens == req.num_tokens_to_compute:
                    self._fork(req)
                    continue
            if not due:
                continue
            req.num_pending_outputs -= 1
            sampled = result.sampled[req.req_id]
            if req.beam is not None:
                groups.setdefault(req.beam, {})[req.req_id] = sampled
                continue
            req.output_token_ids.append(sampled.token_id)
            delta = RequestOutputDelta(
                req_id=req.req_id,
                new_token_ids=[sampled.token_id],
                logprobs=[sampled],
                parent_id=req.parent_id,
                index=req.index,
            )
            status = self._check_stop(req)
            if status is not None:
                self._finish(req, status)
                delta.finished = True
                delta.all_finished = not self.live_requests(req.parent_id or req.req_id)
                delta.finish_reason = "length"
                if status is RequestStatus.FINISHED_STOPPED:
                    delta.finish_reason = "stop"
                    delta.stop_reason = (
                        req.stop_reason if isinstance(req.stop_reason, int) else None
                    )
            outputs.append(delta)
        for group, candidates in groups.items():
            outputs += self._select(group, [candidates[i] for i in group.ids])
        return outputs

    def _select(self, group: BeamGroup, candidates: list[SampledToken]) -> list[RequestOutputDelta]:
        """Applies a beam group's selection: its next beams (tables reassigned, forks for the
        worker), or its end (the best sequences as deltas, best first)."""
        step = group.select(candidates)
        if step.done:
            results = group.results()
            for beam in list(group.beams):
                self._finish(beam, RequestStatus.FINISHED_STOPPED)
            return [
                self._beam_delta(group, i, h, i == len(results) - 1) for i, h in enumerate(results)
            ]
        first = group.beams[0]
        known = first.status is RequestStatus.RUNNING and not (self._unsent & set(group.ids))
        sources = {
            beam_request_id(group.client_id, slot): group.beams[src].req_id
            for slot, (src, _, _) in enumerate(step.forks)
        }
        self.block_manager.reassign(sources)
        added = group.apply(step, known_to_worker=known)
        if first.status is RequestStatus.WAITING:
            group.recompute()  # preempted while its step ran
        if added:
            queue = {
                RequestStatus.RUNNING: self.running,
                RequestStatus.WAITING: self.waiting,
                RequestStatus.SWAPPED: self.swapped,
            }[first.status]
            at = list(queue).index(first) + 1
            for k, beam in enumerate(added):
                queue.insert(at + k, beam)
                self._requests[beam.req_id] = beam
            self._children[group.client_id] += [b.req_id for b in added]
        return []

    def _beam_delta(
        self, group: BeamGroup, index: int, hyp: Hypothesis, last: bool
    ) -> RequestOutputDelta:
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

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended (stop strings live outside)."""
        sp = req.sampling
        num_output = len(req.output_token_ids)
        if (
            num_output >= sp.max_tokens
            or len(req.prompt_token_ids) + num_output >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        if num_output < sp.min_tokens:
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
            if req.req_id in self._unsent:
                self._unsent.remove(req.req_id)
            else:
                self._finished_to_drop.append(req.req_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.swapped.remove(req)
        self.block_manager.free(req.req_id)
        req.status = status
        del self._requests[req.req_id]
        if req.parent_id is not None and (siblings := self._children.get(req.parent_id)):
            siblings.remove(req.req_id)
            if not siblings:
                del self._children[req.parent_id]

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
        prefill = 0
        for r in self.running:
            prefill += max(0, r.num_tokens_to_compute - r.num_computed_tokens - 1)
        seats = self._running_seats()
        bm = self.block_manager
        blocks = 0
        for r in self.swapped:
            seats += _seats_asked(r)
            prefill += max(0, r.num_tokens_to_compute - r.num_computed_tokens - 1)
            blocks += len(bm.get_cpu_block_ids(r.req_id))
        for r in self.waiting:
            seats += _seats_asked(r)
            prefill += r.num_tokens_to_compute - r.num_computed_tokens
            blocks += bm.num_blocks_for(r.num_tokens)
        return Backlog(len(self.running), prefill, seats, blocks, bm.num_free_gpu_blocks)

    def sampling_rows(self, plan: StepPlan) -> frozenset[str]:
        """The requests of a plan awaiting update() that will sample a token in it (what its
        StepResult must carry)."""
        for f in self._in_flight:
            if f.plan is plan:
                return f.sampling
        raise ValueError(f"step {plan.step_id} is not awaiting update()")

    def plan_shape(self, plan: StepPlan) -> StepShape:
        """The shape of a plan just made by schedule() (see `StepShape`)."""
        pairs = ctx = 0
        get = self._requests.get
        for req_id, n in plan.num_scheduled_tokens.items():
            req = get(req_id)
            if req is None:
                continue
            before = req.num_computed_tokens - n  # schedule() advanced it already
            pairs += n * before + n * (n + 1) // 2
            ctx += before
        sampled = len(self.sampling_rows(plan)) if plan.num_scheduled_tokens else 0
        return StepShape(
            rows=len(plan.num_scheduled_tokens),
            tokens=plan.total_num_scheduled_tokens,
            sampled_rows=sampled,
            attention_pairs=pairs,
            context_tokens=ctx,
            swapped_blocks=len(plan.swap_in) + len(plan.swap_out),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_finished(self) -> bool:
        """Finished requests whose worker state the next plan will drop."""
        return bool(self._finished_to_drop)

    @property
    def num_prompt_tokens_scheduled(self) -> int:
        """Prompt tokens whose K/V the worker was told to compute, all plans together."""
        return self._counters.prompt_tokens

    @property
    def kv_usage(self) -> float:
        return self.block_manager.gpu_usage

    def stats(self) -> SchedulerStats:
        c = self._counters
        bm = self.block_manager
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
            num_computed_tokens=c.computed_tokens,
            num_forks=c.forks,
            num_copied_blocks=c.copied_blocks,
            num_used_gpu_blocks=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
            num_gpu_block_refs=bm.num_gpu_block_refs,
            peak_used_gpu_blocks=c.peak_used_gpu_blocks,
            prefix_cache=bm.prefix_cache_stats(),
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
                pending = sum(
                    f.requests.get(req.req_id) is req and req.req_id in f.sampling
                    for f in self._in_flight
                )
                assert req.num_pending_outputs == pending, f"{req.req_id}: pending outputs"
                assert 0 <= req.num_computed_tokens < req.num_tokens or (
                    self._in_flight and req.num_computed_tokens <= req.num_tokens_to_compute
                ), f"{req.req_id}: computed {req.num_computed_tokens} of {req.num_tokens}"
        assert seen == set(self._requests), "tracked requests missing from every queue"
        seats = self._running_seats()
        assert seats <= self.config.max_num_seqs, f"{seats} seats > max_num_seqs"
        assert self._unsent <= {r.req_id for r in self.running}, "unsent requests not running"
        for parent_id, child_ids in self._children.items():
            assert child_ids and parent_id not in self._requests, f"{parent_id}: stale fork"
            for c in child_ids:
                assert self._requests[c].parent_id == parent_id, f"{c}: not a child of {parent_id}"
        for req in self._requests.values():
            if req.parent_id is not None:
                assert req.req_id in self._children.get(req.parent_id, ()), f"{req.req_id}: orphan"
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
        self._check_beam_groups()
        holders = {r.req_id for r in self.running} | {r.req_id for r in self.swapped}
        assert bm.request_ids() <= holders, f"blocks held by {bm.request_ids() - holders}"
        bm.check_integrity()

    def _check_beam_groups(self) -> None:
        groups = {r.beam for r in self._requests.values() if r.beam is not None}
        for group in groups:
            assert self._children.get(group.client_id) == group.ids, f"{group.client_id}: beams"
            assert len(group.scores) == len(group.beams), f"{group.client_id}: scores"
            status = group.beams[0].status
            queue = {
                RequestStatus.RUNNING: self.running,
                RequestStatus.WAITING: self.waiting,
                RequestStatus.SWAPPED: self.swapped,
            }[status]
            items = list(queue)
            at = items.index(group.beams[0])
            assert items[at : at + len(group.beams)] == group.beams, (
                f"{group.client_id}: beams not together in the {status.value} queue"
            )
            lengths = {b.num_tokens for b in group.beams}
            assert len(lengths) == 1, f"{group.client_id}: beams of different lengths {lengths}"
            assert not group.pending_forks or status is RequestStatus.RUNNING, (
                f"{group.client_id}: forks pending for beams the worker does not hold"
            )


def _seats_asked(req: Request) -> int:
    """Seats a request not running needs to start: its beam width, or n."""
    return req.beam.width if req.beam is not None else req.sampling.n
