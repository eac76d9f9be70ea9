"""What a scheduler reports: a delta per sampled token, its statistics, and the backlog that
admission prices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from control_plane.block_manager import PrefixCacheStats
from pagedserve.plan import SampledToken


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
