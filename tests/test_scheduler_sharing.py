"""The scheduler with shared blocks: prefix-cache hits, parallel sampling (n > 1) by fork and
copy-on-write, against the simulated worker of test_scheduler (exact plans and block ids)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from control_plane.request import Request, RequestStatus, child_request_id, child_seed
from control_plane.scheduler import RequestOutputDelta, Scheduler
from pagedserve.plan import BlockMove
from pagedserve.sampling_params import InvalidRequestError, SamplingParams
from tests.test_scheduler import FakeWorker, make, reference_output, run_all, step

PROMPT = list(range(100, 110))  # 10 tokens: two full blocks of 4 and two tokens


def req(req_id: str, prompt: list[int], max_tokens: int = 3, **sampling: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(req_id, list(prompt), sp)


def refcounts(sched: Scheduler, n: int) -> list[int]:
    return sched.block_manager.gpu.refcounts[:n]


# -- prefix caching -------------------------------------------------------------------------------


def test_a_request_starts_from_the_cached_prefix() -> None:
    sched, worker = make(12, prefix_caching=True)
    sched.add_request(req("a", PROMPT, max_tokens=2))
    plan, _ = step(sched, worker)
    assert plan.new_requests[0].block_ids == [0, 1, 2]
    run_all(sched, worker)  # a's 11 computed tokens: blocks 0 and 1 full and cached
    assert sched.block_manager.free_gpu_block_ids()[-3:] == [2, 1, 0]

    b = req("b", [*PROMPT[:8], 7, 7, 7])
    sched.add_request(b)
    plan, _ = step(sched, worker)
    [new] = plan.new_requests
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 3], 8)
    assert plan.num_scheduled_tokens == {"b": 3}
    assert refcounts(sched, 4) == [1, 1, 0, 1]
    run_all(sched, worker)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 3)
    stats = sched.stats().prefix_cache
    assert (stats.num_queries, stats.num_hits) == (2, 1)
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (10 + 11, 8)


def test_a_block_aligned_prompt_recomputes_its_last_token() -> None:
    sched, worker = make(12, prefix_caching=True)
    sched.add_request(req("a", PROMPT[:8], max_tokens=1))
    run_all(sched, worker)  # 8 tokens computed: blocks 0 and 1 cached
    sched.add_request(req("b", PROMPT[:8], max_tokens=2))
    plan, deltas = step(sched, worker)
    [new] = plan.new_requests
    assert (new.block_ids, new.num_computed_tokens) == ([0, 2], 4)
    assert plan.num_scheduled_tokens == {"b": 4}  # block 1 is recomputed into block 2
    assert [d.new_token_ids for d in deltas] == [reference_output(PROMPT[:8], 1)]


@pytest.mark.parametrize("caching", [False, True])
def test_computed_tokens_drop_by_the_hit_tokens(caching: bool) -> None:
    sched, worker = make(12, prefix_caching=caching)
    for name in ("a", "b", "c"):
        sched.add_request(req(name, PROMPT, max_tokens=2))
        run_all(sched, worker)
    stats = sched.stats()
    hit_tokens = 2 * 8 if caching else 0  # b and c find a's two full blocks
    assert stats.prefix_cache.num_hit_tokens == hit_tokens
    assert stats.num_computed_tokens == 3 * (10 + 1) - hit_tokens
    assert stats.prefix_cache.num_queries == (3 if caching else 0)


def test_recomputed_request_reuses_its_own_cached_blocks() -> None:
    sched, worker = make(4, block_size=2, prefix_caching=True)
    a, b = req("a", [1, 2, 3], max_tokens=4), req("b", [4, 5, 6], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)  # a [0, 1], b [2, 3]
    step(sched, worker)  # four tokens each: all four blocks full and cached
    plan, _ = step(sched, worker)  # a needs a third block: b is preempted, a takes b's tail
    assert plan.finished_req_ids == ["b"] and plan.cached_requests[0].new_block_ids == [3]
    assert sched.block_manager.free_gpu_block_ids() == [2]
    step(sched, worker)  # a finishes
    plan, _ = step(sched, worker)
    [new] = plan.new_requests
    # b's first block survived in the free queue; its second was evicted for a.
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("b", [2, 3, 1], 2)
    assert plan.num_scheduled_tokens == {"b": 3}
    run_all(sched, worker)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 4)


# -- parallel sampling ----------------------------------------------------------------------------


def test_n4_forks_after_the_prompt_and_shares_its_blocks() -> None:
    sched, worker = make(16, prefix_caching=True)
    parent = req("p", PROMPT, max_tokens=3, n=4, seed=7)
    sched.add_request(parent)

    plan, deltas = step(sched, worker)  # the parent computes all but the last prompt token
    assert [(r.req_id, r.block_ids) for r in plan.new_requests] == [("p", [0, 1, 2])]
    assert plan.num_scheduled_tokens == {"p": 9} and deltas == []
    assert parent.status is RequestStatus.FORKED and sched.get_request("p") is None
    children = sched.live_requests("p")
    assert [c.req_id for c in children] == ["p#0", "p#1", "p#2", "p#3"]
    assert all(c.num_computed_tokens == 9 and c.parent_id == "p" for c in children)
    assert refcounts(sched, 3) == [4, 4, 4]

    plan, deltas = step(sched, worker)
    assert plan.finished_req_ids == ["p"]
    # Each child's first write goes into the shared last block: all but the last holder copy.
    assert plan.copy_blocks == [BlockMove(2, 3), BlockMove(2, 4), BlockMove(2, 5)]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in plan.new_requests] == [
        ("p#0", [0, 1, 3], 9),
        ("p#1", [0, 1, 4], 9),
        ("p#2", [0, 1, 5], 9),
        ("p#3", [0, 1, 2], 9),
    ]
    assert plan.num_scheduled_tokens == {f"p#{i}": 1 for i in range(4)}
    assert [(d.req_id, d.parent_id, d.index) for d in deltas] == [
        (f"p#{i}", "p", i) for i in range(4)
    ]
    prompt_blocks = {b for r in plan.new_requests for b in r.block_ids[:2]}
    assert prompt_blocks == {0, 1} and refcounts(sched, 6) == [4, 4, 1, 1, 1, 1]
    stats = sched.stats()
    assert (stats.num_forks, stats.num_copied_blocks) == (1, 3)
    assert (stats.num_used_gpu_blocks, stats.num_gpu_block_refs) == (6, 12)

    plan, _ = step(sched, worker)
    assert plan.copy_blocks == [] and all(c.new_block_ids == [] for c in plan.cached_requests)
    assert worker.num_copies == 3


def _run_streams(sched: Scheduler, worker: FakeWorker) -> list[RequestOutputDelta]:
    out = []
    while sched.has_unfinished_requests():
        out += step(sched, worker)[1]
    return out


def test_children_equal_independent_runs_with_the_children_seeds() -> None:
    sched, worker = make(32, prefix_caching=True)
    sched.add_request(req("p", PROMPT, max_tokens=6, n=4, seed=7))
    deltas = _run_streams(sched, worker)
    streamed: dict[str, list[int]] = defaultdict(list)
    for d in deltas:
        streamed[d.req_id] += d.new_token_ids
    assert [d.all_finished for d in deltas].count(True) == 1 and deltas[-1].all_finished

    alone, alone_worker = make(32)
    for i in range(4):
        alone.add_request(req(f"alone{i}", PROMPT, max_tokens=6, seed=child_seed(7, i)))
    expected = run_all(alone, alone_worker)
    assert [streamed[f"p#{i}"] for i in range(4)] == [expected[f"alone{i}"] for i in range(4)]
    assert [streamed[f"p#{i}"] for i in range(4)] == [
        reference_output(PROMPT, 6, child_seed(7, i)) for i in range(4)
    ]
    assert len({tuple(t) for t in streamed.values()}) == 4  # the seed streams differ


def test_finishing_one_child_leaves_the_others_and_releases_its_refs() -> None:
    sched, worker = make(16, prefix_caching=True)
    sched.add_request(req("p", PROMPT, max_tokens=5, n=4, seed=1))
    step(sched, worker)
    step(sched, worker)
    bm = sched.block_manager
    expected = [[3, 3, 1, 0, 1, 1], [2, 2, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    for i, refs in enumerate(expected):
        sched.finish_requests(f"p#{i}", RequestStatus.FINISHED_ABORTED)
        assert refcounts(sched, 6) == refs
        assert [c.index for c in sched.live_requests("p")] == list(range(i + 1, 4))
        sched.check_integrity()
    plan, deltas = step(sched, worker)
    assert plan.finished_req_ids == ["p#0", "p#1", "p#2"]
    assert [(d.req_id, d.all_finished) for d in deltas] == [("p#3", False)]
    deltas = _run_streams(sched, worker)
    assert deltas[-1].finished and deltas[-1].all_finished
    assert bm.num_free_gpu_blocks == 16


def test_aborting_the_parent_aborts_every_child() -> None:
    sched, worker = make(16, prefix_caching=True)
    sched.add_request(req("p", PROMPT, n=3))
    step(sched, worker)
    step(sched, worker)
    sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert sched.live_requests("p") == [] and not sched.has_unfinished_requests()
    plan = sched.schedule()
    assert plan.finished_req_ids == ["p#0", "p#1", "p#2"]
    worker.execute(plan)
    assert worker.reqs == {} and sched.block_manager.num_free_gpu_blocks == 16

    sched.add_request(req("q", PROMPT, n=2, max_tokens=1))  # aborted before it forks
    step(sched, worker)  # cached blocks: q computes only its third block
    sched.add_request(req("r", PROMPT, n=2))
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.get_request("r") is None and sched.num_waiting == 0


def test_a_one_token_prompt_forks_at_once() -> None:
    sched, worker = make(8, prefix_caching=True)
    sched.add_request(req("p", [5], max_tokens=2, n=3))
    plan, deltas = step(sched, worker)
    assert plan.finished_req_ids == [] and plan.copy_blocks == []
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in plan.new_requests] == [
        ("p#0", [0], 0),
        ("p#1", [1], 0),
        ("p#2", [2], 0),
    ]
    assert [d.req_id for d in deltas] == ["p#0", "p#1", "p#2"]
    run_all(sched, worker)


def test_a_fully_cached_prompt_forks_at_admission_without_copies() -> None:
    sched, worker = make(8, prefix_caching=True)
    sched.add_request(req("a", PROMPT[:5], max_tokens=1))
    run_all(sched, worker)  # block 0 cached
    sched.add_request(req("p", PROMPT[:5], max_tokens=2, n=2))
    plan, deltas = step(sched, worker)
    # 4 of 5 prompt tokens cached: nothing left for the parent, which the worker never sees;
    # the last prompt token starts a new block, so nothing is copied either.
    assert plan.finished_req_ids == [] and plan.copy_blocks == []
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in plan.new_requests] == [
        ("p#0", [0, 2], 4),
        ("p#1", [0, 3], 4),
    ]
    assert len(deltas) == 2
    run_all(sched, worker)


def test_a_preempted_child_reshares_the_cached_prompt() -> None:
    sched, worker = make(5, prefix_caching=True)
    sched.add_request(req("p", PROMPT[:9], max_tokens=6, n=2, seed=3))
    plan, _ = step(sched, worker)  # the parent computes 8 tokens: [0, 1], both cached
    assert plan.new_requests[0].block_ids == [0, 1]
    plan, _ = step(sched, worker)  # the last prompt token starts a new block: no copies
    assert [r.block_ids for r in plan.new_requests] == [[0, 1, 2], [0, 1, 3]]
    assert plan.copy_blocks == []
    for _ in range(3):
        plan, _ = step(sched, worker)  # 12 tokens each: blocks 2 and 3 full and cached
    plan, _ = step(sched, worker)  # both need a fourth block; one is free
    assert plan.finished_req_ids == ["p#1"] and plan.cached_requests[0].new_block_ids == [4]
    assert refcounts(sched, 5) == [1, 1, 1, 0, 1]
    step(sched, worker)  # p#0 finishes
    plan, _ = step(sched, worker)
    [new] = plan.new_requests  # back on the prompt blocks and its own cached block 3
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("p#1", [0, 1, 3, 4], 12)
    assert plan.num_scheduled_tokens == {"p#1": 1}
    deltas = _run_streams(sched, worker)
    assert [(d.req_id, d.finished, d.all_finished) for d in deltas] == [("p#1", True, True)]
    assert sched.stats().prefix_cache.num_hits == 1


def test_parent_takes_n_seats() -> None:
    sched, worker = make(16, max_num_seqs=4)
    sched.add_request(req("a", [1, 2], max_tokens=2))
    sched.add_request(req("p", PROMPT, n=4))
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens) == ["a"]
    step(sched, worker)  # a finishes
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens) == ["p"]
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        sched.add_request(req("big", PROMPT, n=5))


def test_parallel_sampling_validation_and_ids() -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(n=17)
    sched, _ = make(16)
    with pytest.raises(ValueError, match="output tokens"):
        sched.add_request(Request("x", [1, 2], SamplingParams(n=2), output_token_ids=[3]))
    with pytest.raises(ValueError, match="n == 1"):
        Request("c", [1], SamplingParams(n=2), parent_id="x")
    assert child_request_id("req-9", 3) == "req-9#3"
    assert child_seed(None, 2) is None
    assert child_seed(7, 0) == 7  # choice 0 of n reproduces the same request with n = 1
    seeds = [child_seed(123, i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(s is not None and 0 <= s < 2**63 for s in seeds)
    assert seeds == [child_seed(123, i) for i in range(16)]
    assert child_seed(0, 1) == 0x45A7ED464495A87
    unseeded = Request("u", [1], SamplingParams(n=2)).make_child(1)
    assert (unseeded.req_id, unseeded.sampling.seed, unseeded.sampling.n) == ("u#1", None, 1)


def test_a_copy_for_a_table_the_worker_holds_fails_loudly() -> None:
    sched, worker = make(8)
    sched.add_request(req("a", [1, 2], max_tokens=4))
    step(sched, worker)
    sched.block_manager.fork("a", "intruder")  # shares a's partial block behind its back
    with pytest.raises(AssertionError, match="copy-on-write in a table the worker holds"):
        sched.schedule()


def test_children_added_by_themselves_form_a_group() -> None:
    """As when a worker's requests move elsewhere with the tokens already streamed."""
    sched, worker = make(16, prefix_caching=True)
    parent = req("p", PROMPT, max_tokens=4, n=3, seed=5)
    for i in (0, 2):
        child = parent.make_child(i)
        child.output_token_ids = reference_output(PROMPT, 4, child.sampling.seed)[:2]
        child.status = RequestStatus.WAITING
        sched.add_request(child)
    assert [r.req_id for r in sched.live_requests("p")] == ["p#0", "p#2"]
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(req("p", PROMPT, n=3))
    deltas = _run_streams(sched, worker)
    assert [(d.req_id, d.all_finished) for d in deltas if d.finished] == [
        ("p#0", False),
        ("p#2", True),
    ]
    for i in (0, 2):
        tokens = [t for d in deltas if d.req_id == f"p#{i}" for t in d.new_token_ids]
        assert tokens == reference_output(PROMPT, 4, child_seed(5, i))[2:]
