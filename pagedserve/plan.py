"""The step contract between the control plane and a worker, as plain domain types.

The scheduler produces a `StepPlan`; the worker executes it and answers with a `StepResult`.
`pagedserve.wire` converts both to and from protobuf at the gRPC edge; nothing else here knows
about protobuf.

A plan carries deltas. The worker keeps, per request, the token ids, the sampling parameters,
the block table and the number of computed tokens. Within one step the worker applies, in
this order:

    1. drop state for `finished_req_ids` (finished, aborted or preempted requests)
    2. swap_out moves (GPU block -> CPU block)   -- before any block is reused below
    3. swap_in moves  (CPU block -> GPU block)
    4. copy_blocks    (GPU block -> GPU block, copy-on-write)
    5. beam_forks     (beam search: a beam takes its source's state plus one token)
    6. register `new_requests` (full state: first schedule or resumed after preemption)
    7. append `new_block_ids` to known requests, and replace their `copied` blocks
    8. run the forward pass over `num_scheduled_tokens`, in that dict's order

A request samples one token in a step exactly when, after the step, all of its known tokens
are computed: num_computed_tokens + num_scheduled_tokens == len(prompt) + len(output). A
beam-search row (sampling.beam_width > 0) samples nothing: it returns its top candidates,
and a later plan's `beam_forks` say which token each beam appends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.sampling_params import SamplingParams


class BlockMove(NamedTuple):
    """Copy the contents of block `src` into block `dst` (ids in the pools the op names)."""

    src: int
    dst: int


@dataclass
class NewRequestData:
    """A request the worker has no state for: scheduled for the first time, or resumed.

    output_token_ids holds tokens already generated before a preemption; the worker treats
    prompt + output as the sequence and the output part for presence/frequency penalties.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the worker already knows whose table grew: the blocks appended since the
    last step. A known request whose table did not grow is only in num_scheduled_tokens.
    copied: blocks of its table replaced by their copy-on-write copies (src -> dst), which
    happens to a beam writing into a block it shares with other beams."""

    req_id: str
    new_block_ids: list[int]
    copied: list[BlockMove] = field(default_factory=list)


@dataclass
class BeamFork:
    """Beam search: request req_id continues from src_req_id's state as it was before the
    plan's forks (tokens, block table, computed count), with token_id appended. req_id may
    be src_req_id (a beam that keeps its own history) or a request the worker does not know
    yet (a new beam)."""

    req_id: str
    src_req_id: str
    token_id: int


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Every request that runs this step -> its number of new tokens; dict order is batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)
    swap_out: list[BlockMove] = field(default_factory=list)
    swap_in: list[BlockMove] = field(default_factory=list)
    copy_blocks: list[BlockMove] = field(default_factory=list)
    beam_forks: list[BeamFork] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (
            self.num_scheduled_tokens
            or self.finished_req_ids
            or self.swap_out
            or self.swap_in
            or self.copy_blocks
            or self.beam_forks
        )


@dataclass
class StepShape:
    """What a plan asks of the model: rows that compute tokens, tokens, rows that sample, the
    query-key pairs attention computes (causal within a row's new tokens), the context tokens
    whose K/V it reads, and blocks moved between the device and the host. It is what a step's
    time depends on (`Scheduler.plan_shape`; the simulator's cost model reads it)."""

    rows: int = 0
    tokens: int = 0
    sampled_rows: int = 0
    attention_pairs: int = 0
    context_tokens: int = 0
    swapped_blocks: int = 0


@dataclass
class SampledToken:
    """One sampled token; logprob fields are set only when the request asked for logprobs."""

    token_id: int
    logprob: float | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0  # 1 = the likeliest token; set for prompt logprobs


@dataclass
class PromptLogprobRun:
    """Prompt tokens start, start + 1, ... each with its log-probability given those before."""

    start: int
    logprobs: list[SampledToken]


@dataclass
class StepResult:
    step_id: int
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    model_time_s: float = 0.0  # forward + sampling
    total_time_s: float = 0.0  # everything the worker did for the step
    # Requests asking for prompt logprobs whose prompt tokens this step computed.
    prompt_logprobs: dict[str, PromptLogprobRun] = field(default_factory=dict)
    # Requests the worker cannot go on with, and why (no token of theirs is in `sampled`).
    failed: dict[str, str] = field(default_factory=dict)
    # Requests whose part of the plan contradicted the worker's state, and why: forgotten there.
    refused: dict[str, str] = field(default_factory=dict)
