"""A request as the scheduler sees it: a few stored counters, the rest derived.

Accounting follows one rule instead of a prefill/decode state machine: the request's
`num_computed_tokens` (tokens whose KV is in the cache) catches up with its `num_tokens`
(prompt + output). A step schedules some of the gap; when the gap closes the step samples one
token, which opens a gap of one again.

    all_token_ids:  [ prompt ............ | output ...... ]
                    [ computed ...........|.. scheduled | not yet ]
                    0                 num_computed_tokens      num_tokens
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from pagedserve.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

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


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    output_token_ids survive preemption: a recomputed request re-prefills prompt + output, so
    no token is lost or sampled twice. stop_reason is the stop token id or stop string that
    ended the request, when one did.
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

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id}: the prompt must have at least one token")

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
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason
