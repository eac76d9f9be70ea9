"""The engine core without a transport: plans in flight, step ids, cache events."""

from __future__ import annotations

import pytest

from control_plane.block_manager import BlockManager
from control_plane.engine_core import EngineCore
from control_plane.request import Request
from control_plane.scheduler import Scheduler, SchedulerConfig
from pagedserve.plan import SampledToken, StepPlan, StepResult
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2


def new_scheduler() -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=(EOS,)
    )
    return Scheduler(cfg, BlockManager(32, 0, BLOCK_SIZE, enable_prefix_caching=True))


def add(core: EngineCore, req_id: str, prompt_len: int = 9, max_tokens: int = 3) -> None:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.scheduler.add_request(Request(req_id, list(range(3, 3 + prompt_len)), sp, 0.0))


def result_for(core: EngineCore, plan: StepPlan, token: int = 7) -> StepResult:
    due = core.scheduler.sampling_rows(plan)
    return StepResult(plan.step_id, {r: SampledToken(token_id=token) for r in due})


@pytest.mark.parametrize("async_scheduling, depth", [(True, 2), (False, 1)])
def test_plans_in_flight_up_to_the_async_depth(async_scheduling: bool, depth: int) -> None:
    core = EngineCore(new_scheduler, async_scheduling)
    assert core.next_plan() is None  # nothing to schedule
    add(core, "a")
    sent = []
    while (plan := core.next_plan()) is not None:
        sent.append(plan)
    assert len(sent) == depth == len(core.in_flight)
    assert core.oldest is sent[0]
    deltas = core.apply(result_for(core, sent[0]))
    assert [d.req_id for d in deltas] == ["a"]
    assert list(core.in_flight) == sent[1:]
    assert core.counters.num_steps == 1
    assert core.counters.num_prompt_tokens_computed == 9


def test_step_ids_are_the_schedulers_and_go_on_after_a_reset() -> None:
    core = EngineCore(new_scheduler, async_scheduling=False)
    add(core, "a", max_tokens=8)
    ids = []
    for _ in range(3):
        plan = core.next_plan()
        assert plan is not None
        ids.append(plan.step_id)
        core.apply(result_for(core, plan))
    assert ids == sorted(set(ids))
    core.drop_in_flight()
    core.reset()
    add(core, "b")
    plan = core.next_plan()
    assert plan is not None and plan.step_id > ids[-1]
    assert core.scheduler.next_step_id == plan.step_id + 1


def test_cache_events_fold_and_a_reset_restates_the_cache() -> None:
    core = EngineCore(new_scheduler, async_scheduling=False)
    add(core, "a", prompt_len=9, max_tokens=1)
    plan = core.next_plan()
    assert plan is not None
    core.apply(result_for(core, plan))
    ev = core.drain_cache_events()
    assert len(ev.stored) == 2 and not ev.removed and not ev.replace  # two full blocks
    assert sorted(ev.stored) == sorted(core.cached_block_hashes())
    assert core.drain_cache_events().stored == []
    core.reset(restate_cache=False)
    assert not core.drain_cache_events().replace
    core.reset()
    ev = core.drain_cache_events()
    assert ev.replace and ev.stored == [] and ev.removed == []
