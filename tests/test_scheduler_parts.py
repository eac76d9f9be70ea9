"""The scheduler's parts on their own: a step's budget (`StepBuilder`), the pure stop checks,
and the layering that keeps `control_plane/request.py` below the beam search."""

from __future__ import annotations

import ast
from pathlib import Path

from control_plane.block_manager import BlockManager
from control_plane.request import Request, RequestStatus
from control_plane.scheduler import SchedulerConfig
from control_plane.scheduler.state import SchedulerState
from control_plane.scheduler.step import StepBuilder
from control_plane.scheduler.stop import Stop, check_stop, tokens_left
from pagedserve.plan import StepPlan
from pagedserve.sampling_params import SamplingParams


def _state(**config: object) -> SchedulerState:
    cfg = SchedulerConfig(**{"max_model_len": 64, **config})  # type: ignore[arg-type]
    return SchedulerState(cfg, BlockManager(16, 0, 4, False))


def _running(state: SchedulerState, prompt_len: int, computed: int) -> Request:
    req = Request(f"r{len(state.running)}", list(range(1, prompt_len + 1)), SamplingParams())
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = computed
    state.running.append(req)
    return req


def test_a_step_caps_chunks_by_both_budgets() -> None:
    state = _state(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    step = StepBuilder(state, StepPlan(0))
    assert (step.tokens, step.prompt) == (10, 10)  # nothing decodes: the whole budget
    assert step.cap(3) == 3
    assert step.cap(20) == 6  # the long-prefill threshold
    step.prompt = 2
    assert step.cap(5) == 2  # a chunk takes what the prompt budget has left
    assert step.cap(1) == 1  # a decode does not need it
    step.prompt = 0
    assert step.cap(5) == 1


def test_a_step_with_a_decode_gives_prompts_their_cap() -> None:
    state = _state(max_num_batched_tokens=10, max_prefill_tokens_with_decodes=4)
    _running(state, prompt_len=8, computed=3)  # mid-prefill: no decode yet
    assert StepBuilder(state, StepPlan(0)).prompt == 10
    _running(state, prompt_len=8, computed=7)  # its last prompt token: it decodes
    assert StepBuilder(state, StepPlan(1)).prompt == 4


def test_stop_checks_name_what_ended_the_request() -> None:
    config = SchedulerConfig(max_model_len=12, eos_token_ids=(2,))
    sp = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(7, 2))
    req = Request("r", [1, 1, 1], sp, output_token_ids=[2])
    assert check_stop(req, config) is None  # EOS before min_tokens
    req.output_token_ids = [3, 2]
    assert check_stop(req, config) == Stop(RequestStatus.FINISHED_STOPPED)  # EOS, not a stop id
    req.output_token_ids = [3, 7]
    assert check_stop(req, config) == Stop(RequestStatus.FINISHED_STOPPED, 7)
    req.output_token_ids = [3, 4, 5, 6, 8]
    assert check_stop(req, config) == Stop(RequestStatus.FINISHED_LENGTH)
    long = Request("l", [1] * 10, sp, output_token_ids=[3, 4])
    assert check_stop(long, config) == Stop(RequestStatus.FINISHED_LENGTH)  # max_model_len
    assert req.stop_reason is None  # pure: the caller records the stop token


def test_pending_outputs_that_end_a_request_leave_it_nothing_to_compute() -> None:
    config = SchedulerConfig(max_model_len=64)
    for max_tokens, left in ((2, 0), (3, 1)):
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), output_token_ids=[4])
        req.num_computed_tokens = 4
        req.num_pending_outputs = 1  # its second token, in flight
        assert tokens_left(req, config) == left


def test_requests_import_nothing_above_them() -> None:
    source = Path(__file__).parents[1] / "control_plane" / "request.py"
    imported = {
        node.module
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert {m for m in imported if m.startswith("control_plane")} == {"control_plane.block_hash"}


def test_a_recomputed_beam_group_with_less_budget_than_beams_waits() -> None:
    """A beam group preempted by recompute, every beam one token short, readmitted behind a
    request that leaves it less budget than it has beams: nothing of it fits this step, so it
    waits (schedule() used to raise from zip), and it runs to the end afterwards."""
    from collections import deque

    from control_plane.block_manager import BlockManager
    from control_plane.request import Request
    from control_plane.scheduler import Scheduler, SchedulerConfig
    from control_plane.scheduler.preemption import preempt
    from control_plane.scheduler.units import pop_newest
    from pagedserve.plan import SampledToken, StepPlan, StepResult
    from pagedserve.sampling_params import SamplingParams

    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64)
    s = Scheduler(cfg, BlockManager(14, 0, 4, True))
    beams = SamplingParams(max_tokens=6, beam_width=3, temperature=0.0)
    s.add_request(Request("g", list(range(1, 9)), beams))

    def step() -> StepPlan:
        p = s.schedule()
        rows = s.sampling_rows(p) if p.num_scheduled_tokens else ()
        top = [20 + k for k in range(6)], [-0.1 * (k + 1) for k in range(6)]
        s.update(p, StepResult(p.step_id, {r: SampledToken(20, -0.1, *top) for r in rows}))
        s.check_integrity()
        return p

    for _ in range(6):
        step()
        if len(s.running) == 3:
            break
    assert len(s.running) == 3
    preempt(s, pop_newest(s.running), StepPlan(99))
    s.add_request(Request("x", [500, 501, 502], SamplingParams(max_tokens=20)))
    s.waiting = deque([s.waiting[-1], *list(s.waiting)[:-1]])  # x ahead, an earlier arrival
    for _ in range(60):
        step()
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
