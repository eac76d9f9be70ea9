"""A request as the scheduler sees it: a few stored counters, the rest derived.

Accounting follows one rule instead of a prefill/decode state machine: the request's
`num_computed_tokens` (tokens whose KV is in the cache) catches up with its `num_tokens`
(prompt + output). A step schedules some of the gap; when the gap closes the step samples one
token, which opens a gap of one again.

    all_token_ids:  [ prompt ............ | output ...... ]
                    [ computed ...........|.. scheduled | not yet ]
                    0                 num_computed_tokens      num_tokens

With a step in flight (async scheduling), a step that will sample leaves a pending output: a
token the worker has sampled, or will, that the scheduler does not know yet. It counts toward
`num_tokens_to_compute`, so the next step can already feed it back (the worker holds its id),
and becomes an output token when its step's result is applied.

Parallel sampling (sampling.n > 1): the request is a fork parent. It computes its prompt up to
the last token and never samples; the scheduler then forks it into n children (`make_child`),
each an ordinary n == 1 request that shares the parent's blocks, computes the last prompt token
itself and samples with its own seed stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from control_plane.block_hash import BlockHash, request_block_hashes
from pagedserve.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FORKED = "forked"  # a fork parent replaced by its children; not finished, in no queue

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class SequenceGroup(Protocol):
    """The group a request is one sequence of, scheduled with it as one unit: a beam search's
    `BeamGroup` (`control_plane/beam.py`, which builds its beams from this module). A request
    names only what its holders ask of the group, so this module imports nothing above it."""

    def copy_waiting(self) -> list[Request]:
        """Fresh WAITING copies of the group's live sequences, in a copy of the group."""
        ...


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    output_token_ids survive preemption: a recomputed request re-prefills prompt + output, so
    no token is lost or sampled twice. stop_reason is the stop token id or stop string that
    ended the request, when one did.

    cache_salt is mixed into every block hash, so only requests with the same salt share cached
    blocks. parent_id and index are set on a parallel-sampling child. block_hashes holds the
    chained hashes of the request's full blocks for one block size, extended lazily by
    `extend_block_hashes` (the caller may preset them, e.g. when it already hashed the prompt).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None
    parent_id: str | None = None
    index: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_pending_outputs: int = 0  # sampled by steps in flight, not applied yet
    beam: SequenceGroup | None = None  # set on a beam of a beam search (`BeamGroup`)
    # n > 1 outside beam search: the prompt is computed once, then n children fork from it.
    # Read on every scheduling pass; the sampling parameters never change.
    is_fork_parent: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id}: the prompt must have at least one token")
        if self.parent_id is not None and self.sampling.n != 1:
            raise ValueError(f"request {self.req_id}: a child must have n == 1")
        self.is_fork_parent = self.sampling.n > 1 and not self.sampling.beam_width

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_to_compute(self) -> int:
        """Where num_computed_tokens is headed: all tokens (pending outputs included), or for a
        fork parent all but the last prompt token (which each child computes itself, to sample
        from)."""
        if self.is_fork_parent:
            return len(self.prompt_token_ids) - 1
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_outputs

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def extend_block_hashes(self, block_size: int) -> None:
        """Hash every full block (prompt and output tokens) not hashed yet."""
        start = len(self.block_hashes) * block_size
        end = self.num_tokens // block_size * block_size
        if end > start:
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.token_ids_slice(start, end)
            self.block_hashes += request_block_hashes(tokens, block_size, self.cache_salt, parent)

    def make_child(self, index: int) -> Request:
        """Parallel-sampling child `index` of this fork parent: same prompt, progress and
        hashes; n == 1 and its own seed (see `child_seed`)."""
        assert self.is_fork_parent and not self.output_token_ids, f"{self.req_id}: not a parent"
        sampling = replace(self.sampling, n=1, seed=child_seed(self.sampling.seed, index))
        return Request(
            req_id=child_request_id(self.req_id, index),
            prompt_token_ids=list(self.prompt_token_ids),
            sampling=sampling,
            arrival_time=self.arrival_time,
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            cache_salt=self.cache_salt,
            parent_id=self.req_id,
            index=index,
            block_hashes=list(self.block_hashes),
        )


def child_request_id(parent_id: str, index: int) -> str:
    """The request id of parallel-sampling child `index` of `parent_id`."""
    return f"{parent_id}#{index}"


def child_seed(seed: int | None, index: int) -> int | None:
    """Child `index`'s seed: the request's own seed for child 0 (so choice 0 of n equals the
    same request with n = 1), and a fixed mix of seed and index for the others, in [0, 2**63),
    so that every child draws an independent, reproducible stream. Unseeded stays unseeded."""
    if seed is None or index == 0:
        return seed
    return _splitmix64(_splitmix64(seed) ^ index) >> 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
