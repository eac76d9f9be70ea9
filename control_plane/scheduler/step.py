"""The step being made: its plan and its token budget, in one object that the passes ask.

As mini-sglang's `PrefillAdder` owns a prefill batch's budget, `StepBuilder` owns a step's: a
pass asks it how many tokens a request gets (`cap`), reserves the request's slots through it
(preempting newer units when blocks run out), and hands it the request (`add`), which writes
the plan's entries and charges the budget. Two budgets run together:

    tokens: max_num_batched_tokens, every scheduled token
    prompt: of those, what chunks of more than one token may take (prompts, recomputation);
            max_prefill_tokens_with_decodes where a running request decodes in the step

Copy-on-write and the worker: the worker learns a replaced block from a full table
(`NewRequestData`), or, for a beam, from `CachedRequestData.copied`. Outside beam search a copy
is only ever needed on a request's first schedule after a fork, so a copy for a request the
worker already knows is a bug, and `add` asserts against it.
"""

from __future__ import annotations

from control_plane.block_manager import SlotReservation
from control_plane.request import Request
from control_plane.scheduler.preemption import preempt
from control_plane.scheduler.state import InFlight, SchedulerState
from control_plane.scheduler.stop import tokens_left
from control_plane.scheduler.units import pop_newest
from pagedserve.plan import BlockMove, CachedRequestData, NewRequestData, StepPlan


class StepBuilder:
    """One step's plan as the passes fill it, and the budget left for it.

    `chunked`: a request got fewer tokens than its last one; `preempted`: the step preempted
    a unit (the swapped and waiting queues then wait for a later step).
    """

    def __init__(self, state: SchedulerState, plan: StepPlan) -> None:
        self.state = state
        self.plan = plan
        config = state.config
        self.tokens = config.max_num_batched_tokens
        self.prompt = self.tokens  # of `tokens`, what chunks of more than one token may take
        cap = config.max_prefill_tokens_with_decodes
        if cap is not None and cap < self.tokens and self._any_decoding():
            self.prompt = cap
        self.chunked = False
        self.preempted = False

    def _any_decoding(self) -> bool:
        """Whether a running request computes its one next token in the step being made (the
        oldest running one, most often)."""
        config = self.state.config
        return any(tokens_left(r, config) == 1 for r in self.state.running)

    # -- the budget ---------------------------------------------------------------------------

    def cap(self, num_tokens: int) -> int:
        """Tokens a request with num_tokens to compute gets: a chunk of more than one token
        within the prompt budget too (at least one token while that has any left)."""
        num_new = num_tokens if num_tokens < self.tokens else self.tokens
        if num_new > 1 and num_new > self.prompt:
            num_new = max(1, self.prompt)
        cap = self.state.config.long_prefill_token_threshold
        return num_new if cap is None or num_new <= cap else cap

    def num_new_tokens(self, req: Request) -> int:
        left = req.num_tokens_to_compute - req.num_computed_tokens
        assert left > 0, f"request {req.req_id} has nothing to compute"
        return self.cap(left)

    # -- blocks -------------------------------------------------------------------------------

    def reserve(self, req: Request, num_new: int) -> SlotReservation | None:
        start = req.num_computed_tokens
        return self.state.block_manager.reserve_slots(req.req_id, start, start + num_new)

    def reserve_or_preempt(self, req: Request, num_new: int) -> SlotReservation | None:
        """Reserves req's slots, preempting the newest running units until they fit; None
        when req itself (or its beam group) was preempted."""
        while (slots := self.reserve(req, num_new)) is None:
            if req in self.preempt_newest():  # never one scheduled before req
                return None
        return slots

    def preempt_newest(self) -> list[Request]:
        """Preempts the newest running unit; returns its requests."""
        victims = pop_newest(self.state.running)
        preempt(self.state, victims, self.plan)
        self.preempted = True
        return victims

    def swap_in(self, moves: list[BlockMove]) -> None:
        self.plan.swap_in.extend(moves)
        self.state.counters.swapped_in_blocks += len(moves)

    # -- the plan -----------------------------------------------------------------------------

    def add(
        self,
        req: Request,
        num_new: int,
        slots: SlotReservation,
        chunked: bool | None = None,
    ) -> None:
        """Put a running request with its reserved slots into the plan; `chunked`: whether
        num_new falls short of its last token, when the caller knows."""
        plan, state = self.plan, self.state
        if slots.copies:
            plan.copy_blocks.extend(slots.copies)
            state.counters.copied_blocks += len(slots.copies)
        if req.req_id in state.unsent:
            state.unsent.remove(req.req_id)
            plan.new_requests.append(
                NewRequestData(
                    req_id=req.req_id,
                    prompt_token_ids=list(req.prompt_token_ids),
                    output_token_ids=list(req.output_token_ids),
                    sampling=req.sampling,
                    block_ids=state.block_manager.get_block_ids(req.req_id),
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
        self.tokens -= num_new
        if num_new > 1:
            self.prompt -= num_new
        if chunked is None:
            chunked = req.num_computed_tokens + num_new < req.num_tokens_to_compute
        self.chunked |= chunked

    def advance(self) -> InFlight:
        """Moves each scheduled request past this plan's tokens; one that reaches its last token
        gets a pending output."""
        requests: dict[str, Request] = {}
        sampling: set[str] = set()
        live = self.state.requests
        prompt_tokens = 0
        for req_id, num_new in self.plan.num_scheduled_tokens.items():
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
        self.state.counters.prompt_tokens += prompt_tokens
        return InFlight(self.plan, requests, frozenset(sampling))
