"""How long one worker's steps take, as the control plane sees them and as the worker reports
them; and the optional step trace (`--step-trace`).

The admission check's queue delay reads `step_cost`; the health watcher reads the deadline of
the oldest plan in flight (`expected_step_s`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from typing import TextIO

from control_plane.admission import StepCost
from pagedserve.plan import StepPlan, StepResult, StepShape

# Before a worker has returned a step there is nothing to scale from: its first step (which
# may replay a lost worker's requests, or warm kernels) may take this long.
UNMEASURED_STEP_S = 30.0


class StepTelemetry:
    def __init__(self, address: str) -> None:
        self.address = address
        self.step_cost = StepCost()  # the worker's recent steps, for admission's queue delay
        self._step_s = 0.0  # the worker's recent slowest step (a decaying maximum)
        self._token_s = 0.0  # its recent slowest time per scheduled token (the same)
        self._sent_at: dict[int, float] = {}  # step id -> when it was sent (perf_counter)
        self._last_result_at = 0.0
        self._trace: TextIO | None = None
        self._traced: dict[int, StepShape] = {}  # step id -> shape

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    def trace_to(self, path: str) -> None:
        """Appends one JSON line per step to `path`: the worker, the step's shape
        (`Scheduler.plan_shape`), when it was sent and its result read (perf_counter
        seconds), the worker's own time, `seconds`: from the later of its send and the
        previous result to its result, the step's length as the control plane sees it, and
        `new`: the requests the worker gets whole in it (first scheduled, or resumed)."""
        self._trace = open(path, "a", buffering=1)  # noqa: SIM115 - closed with the process

    def sent(self, plan: StepPlan, shape: StepShape | None) -> None:
        """A plan goes to the worker now; `shape` only when tracing."""
        if shape is not None:
            self._traced[plan.step_id] = shape
        self._sent_at[plan.step_id] = time.perf_counter()

    def received(self, plan: StepPlan, result: StepResult) -> None:
        """The plan's result arrived now."""
        now = time.perf_counter()
        # The step's length as the control plane sees it: from the later of its send and the
        # previous result to its own.
        sent = self._sent_at.pop(plan.step_id, now)
        seconds = now - max(sent, self._last_result_at)
        self._last_result_at = now
        self.step_cost.observe(plan.total_num_scheduled_tokens, seconds)
        self._step_s = max(result.total_time_s, 0.9 * self._step_s)
        per_token = result.total_time_s / max(1, plan.total_num_scheduled_tokens)
        self._token_s = max(per_token, 0.9 * self._token_s)
        if self._trace is not None:
            self._write_trace(plan, result, sent, now, seconds)

    def dropped(self) -> None:
        """The plans in flight were dropped: their results will never come."""
        self._sent_at.clear()

    def elapsed_s(self, oldest: StepPlan | None) -> float:
        """How long the oldest plan in flight has run, as the control plane sees it."""
        if oldest is None:
            return 0.0
        now = time.perf_counter()
        sent = self._sent_at.get(oldest.step_id, now)
        return now - max(sent, self._last_result_at)

    def expected_step_s(self, in_flight: Iterable[StepPlan]) -> float:
        """What the plans in flight should take: the recent slowest step, or their tokens at
        the recent slowest time per token (a worker handed other workers' requests replays
        their tokens in steps far larger than its last)."""
        if self._step_s == 0.0:
            return UNMEASURED_STEP_S
        tokens = sum(p.total_num_scheduled_tokens for p in in_flight)
        return max(self._step_s, tokens * self._token_s)

    def _write_trace(
        self, plan: StepPlan, result: StepResult, sent: float, now: float, seconds: float
    ) -> None:
        assert self._trace is not None
        shape = self._traced.pop(plan.step_id, None)
        if shape is not None:
            line = {
                "worker": self.address,
                "step": plan.step_id,
                **dataclasses.asdict(shape),
                "sent": sent,
                "received": now,
                "seconds": seconds,
                "worker_seconds": result.total_time_s,
                "new": [r.req_id for r in plan.new_requests],
            }
            self._trace.write(json.dumps(line) + "\n")
