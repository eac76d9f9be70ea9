"""Token-level stop checks, pure: whether the token just appended ends a request, and whether
the outputs still pending will (stop strings are checked outside the scheduler)."""

from __future__ import annotations

from typing import NamedTuple

from control_plane.request import Request, RequestStatus
from control_plane.scheduler.config import SchedulerConfig


class Stop(NamedTuple):
    status: RequestStatus  # FINISHED_LENGTH or FINISHED_STOPPED
    stop_token_id: int | None = None  # the stop_token_ids entry that ended the request


def check_stop(req: Request, config: SchedulerConfig) -> Stop | None:
    """Whether the request's last output token ends it: by length (max_tokens or
    max_model_len), EOS, or a stop token, after min_tokens."""
    sp = req.sampling
    num_output = len(req.output_token_ids)
    if (
        num_output >= sp.max_tokens
        or len(req.prompt_token_ids) + num_output >= config.max_model_len
    ):
        return Stop(RequestStatus.FINISHED_LENGTH)
    if num_output < sp.min_tokens:
        return None
    last = req.output_token_ids[-1]
    if not sp.ignore_eos and last in config.eos_token_ids:
        return Stop(RequestStatus.FINISHED_STOPPED)
    if last in sp.stop_token_ids:
        return Stop(RequestStatus.FINISHED_STOPPED, last)
    return None


def tokens_left(req: Request, config: SchedulerConfig) -> int:
    """Tokens a running request may compute now: 0 when the rest is in flight (a fork
    parent's prompt) or its pending outputs will end it by length."""
    left = req.num_tokens_to_compute - req.num_computed_tokens
    pending = req.num_pending_outputs
    if left <= 0 or not pending:
        return left
    num_output = len(req.output_token_ids) + pending
    if (
        num_output < req.sampling.max_tokens
        and len(req.prompt_token_ids) + num_output < config.max_model_len
    ):
        return left
    return 0
