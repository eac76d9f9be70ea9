"""How long a request would wait for its first token because of the others: the estimate
behind `--max-queue-delay`.

A worker step's seconds are close to a line in the tokens it computes: a fixed part (weights
streamed once, launches, the round trip) and a part per token. `StepCost` fits that line to
the worker's recent steps as they come back. A request added now waits for the steps already
in flight, then for the steps that compute the prompt tokens queued before its own (each also
decoding one token for every running row), and then for its own prompt; alone it would need
only the last part. The difference is its queue delay. A request that would need a seat or
KV blocks that only a finishing request can free has no estimate: its wait depends on output
lengths nobody knows yet, and it counts as infinite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from control_plane.scheduler import Backlog, SchedulerConfig

# Each step's weight in the fit is this many times the next one's: about the last 30 steps
# count, so the line follows the batch as it grows or drains.
DECAY = 0.97


class StepCost:
    """Seconds of one step as `fixed + per_token x tokens`, fitted by least squares over the
    recent steps (exponentially forgotten)."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token); (0, 0) before any step."""
        if self._w == 0.0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        per_token = (self._xy / self._w - mx * my) / var if var > 1e-6 * (1.0 + mx * mx) else 0.0
        fixed = my - per_token * mx
        if per_token <= 0.0 or fixed < 0.0:
            # Steps all of one size, or noise steeper than the data: a line through the mean
            # that scales with tokens only where it must stay positive.
            if fixed < 0.0:
                return 0.0, my / mx if mx > 0 else 0.0
            return my, 0.0
        return fixed, per_token

    def seconds(self, tokens: int) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * tokens


def queue_delay(
    cost: StepCost,
    config: SchedulerConfig,
    backlog: Backlog,
    in_flight_tokens: Iterable[int],
    elapsed_s: float,
    prompt_tokens: int,
    seats: int,
    blocks: int,
) -> float:
    """Seconds a request of `prompt_tokens` (taking `seats` seats and `blocks` KV blocks to
    start) added now is expected to wait for its first token beyond what it would alone
    (math.inf: only a finishing request can make room for it). `in_flight_tokens` are the
    plans sent and not yet answered, the oldest of which has run `elapsed_s`."""
    if backlog.seats + seats > config.max_num_seqs:
        return math.inf
    if backlog.blocks_needed + blocks > backlog.free_blocks:
        return math.inf
    fixed, per_token = cost.line()
    # The oldest plan runs now: what is left of it, none once it has run past its estimate
    # (its overrun is no credit against the plans behind it, which the worker has not begun).
    wait = 0.0
    for i, tokens in enumerate(in_flight_tokens):
        seconds = fixed + per_token * tokens
        wait += max(0.0, seconds - elapsed_s) if i == 0 else seconds
    budget = config.max_num_batched_tokens - backlog.rows
    cap = config.max_prefill_tokens_with_decodes
    if backlog.rows and cap is not None:  # prompts share what decodes leave, up to the cap
        budget = min(budget, cap)
    budget = max(1, budget)
    work = backlog.prefill_tokens + prompt_tokens
    steps = -(-work // budget)
    shared = steps * fixed + per_token * (steps * backlog.rows + work)
    alone = -(-prompt_tokens // config.max_num_batched_tokens) * fixed + per_token * prompt_tokens
    return max(0.0, wait + shared - alone)
