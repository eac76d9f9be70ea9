"""The scheduler against a simulated worker: exact plans, preemption, swap, token accounting.

`FakeWorker` plays the worker's side of the plan contract over a simulated KV pool in which
every slot holds (position, token id, digest of the tokens up to it), as a real K/V depends on
the whole prefix. It reads a request's whole context through its block table before sampling,
so a lost, stale or misplaced block changes the sampled token or fails an assertion, and it
refuses a write into a block another request it knows holds (a missed copy-on-write). Tokens
are a function of the context and the seed alone, so every request's output must equal
`reference_output` whatever the batching, chunking, preemption or prefix caching.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from control_plane.block_manager import BlockManager
from control_plane.request import Request, RequestStatus, child_seed
from control_plane.scheduler import RequestOutputDelta, Scheduler, SchedulerConfig
from pagedserve.plan import BlockMove, SampledToken, StepPlan, StepResult
from pagedserve.sampling_params import InvalidRequestError, SamplingParams

KV = tuple[int, int, int]  # (position, token id, prefix digest) as written into a slot
SampleFn = Callable[[str, list[int]], int]
_P = 2**61 - 1


def _digests(tokens: Sequence[int]) -> list[int]:
    out, h = [], 17
    for pos, tok in enumerate(tokens):
        h = (h * 1_000_003 + tok * 31 + pos) % _P
        out.append(h)
    return out


def next_token(context: Sequence[int], seed: int | None = None) -> int:
    h = _digests(context)[-1] if context else 17
    if seed is not None:
        h = (h * 7919 + seed) % _P
    return 10 + h % 1000


def reference_output(
    prompt: Sequence[int], max_tokens: int, seed: int | None = None, stop: Sequence[int] = ()
) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, seed))
        if tokens[-1] in stop:
            break
    return tokens[len(prompt) :]


# Stop token ids that end about a third of the machine's requests' steps.
MACHINE_STOP_IDS = tuple(range(10, 310))


@dataclass
class _WorkerRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    seed: int | None


class FakeWorker:
    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        sample: SampleFn | None = None,
    ) -> None:
        self.block_size = block_size
        self.gpu: list[list[KV | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[KV | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.reqs: dict[str, _WorkerRequest] = {}
        self.sample: SampleFn = sample or self._sample_by_seed
        self.num_copies = 0

    def _sample_by_seed(self, req_id: str, context: list[int]) -> int:
        return next_token(context, self.reqs[req_id].seed)

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            del self.reqs[req_id]  # KeyError: a drop for a request the worker never knew
        for m in plan.swap_out:
            self.cpu[m.dst] = list(self.gpu[m.src])
        for m in plan.swap_in:
            self.gpu[m.dst] = list(self.cpu[m.src])
        for m in plan.copy_blocks:
            self.gpu[m.dst] = list(self.gpu[m.src])
            self.num_copies += 1
        for new in plan.new_requests:
            assert new.req_id not in self.reqs, f"{new.req_id} registered twice"
            tokens = new.prompt_token_ids + new.output_token_ids
            seed = new.sampling.seed
            self.reqs[new.req_id] = _WorkerRequest(tokens, list(new.block_ids), 0, seed)
            self._read(new.req_id, new.num_computed_tokens)  # resumed KV must be intact
            self.reqs[new.req_id].num_computed = new.num_computed_tokens
        for cached in plan.cached_requests:
            self.reqs[cached.req_id].block_ids += cached.new_block_ids
        holders: dict[int, set[str]] = defaultdict(set)
        for req_id, r in self.reqs.items():
            assert len(set(r.block_ids)) == len(r.block_ids), f"{req_id} holds a block twice"
            for b in r.block_ids:
                holders[b].add(req_id)
        named = {r.req_id for r in plan.new_requests} | {r.req_id for r in plan.cached_requests}
        assert named <= set(plan.num_scheduled_tokens), "a plan entry for an idle request"
        # A known request whose table did not grow is named by num_scheduled_tokens alone.
        assert all(req_id in self.reqs for req_id in plan.num_scheduled_tokens)

        sampled: dict[str, SampledToken] = {}
        bs = self.block_size
        for req_id, n in plan.num_scheduled_tokens.items():
            r = self.reqs[req_id]
            self._read(req_id, r.num_computed)
            assert r.num_computed + n <= len(r.tokens)
            digests = _digests(r.tokens[: r.num_computed + n])
            for pos in range(r.num_computed, r.num_computed + n):
                block = r.block_ids[pos // bs]
                assert holders[block] == {req_id}, f"{req_id} writes into shared block {block}"
                self.gpu[block][pos % bs] = (pos, r.tokens[pos], digests[pos])
            r.num_computed += n
            if r.num_computed == len(r.tokens):
                token = self.sample(req_id, self._read(req_id, r.num_computed))
                r.tokens.append(token)
                sampled[req_id] = SampledToken(token)
        return StepResult(plan.step_id, sampled)

    def _read(self, req_id: str, num_tokens: int) -> list[int]:
        r = self.reqs[req_id]
        bs = self.block_size
        digests = _digests(r.tokens[:num_tokens])
        context = []
        for pos in range(num_tokens):
            kv = self.gpu[r.block_ids[pos // bs]][pos % bs]
            assert kv == (pos, r.tokens[pos], digests[pos]), f"{req_id}: bad KV at {pos}: {kv}"
            context.append(kv[1])
        return context


def make(
    num_gpu_blocks: int,
    num_cpu_blocks: int = 0,
    block_size: int = 4,
    sample: SampleFn | None = None,
    prefix_caching: bool = False,
    **config: object,
) -> tuple[Scheduler, FakeWorker]:
    """A scheduler and its worker; prefix caching is off unless asked for, so that the exact
    block ids of the tests below show plain allocation."""
    cfg = SchedulerConfig(**{"max_model_len": 1024, **config})  # type: ignore[arg-type]
    bm = BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, prefix_caching)
    return Scheduler(cfg, bm), FakeWorker(num_gpu_blocks, num_cpu_blocks, block_size, sample)


def request(req_id: str, prompt_len: int, max_tokens: int = 8, **sampling: object) -> Request:
    base = 1 + sum(map(ord, req_id)) % 500
    prompt = [base + i for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(req_id, prompt, sp)


def step(sched: Scheduler, worker: FakeWorker) -> tuple[StepPlan, list[RequestOutputDelta]]:
    plan = sched.schedule()
    sched.check_integrity()
    deltas = sched.update(plan, worker.execute(plan))
    sched.check_integrity()
    return plan, deltas


def run_all(sched: Scheduler, worker: FakeWorker, max_steps: int = 5000) -> dict[str, list[int]]:
    """Step until every request finished; returns the streamed tokens per request."""
    streamed: dict[str, list[int]] = defaultdict(list)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, deltas = step(sched, worker)
        for d in deltas:
            streamed[d.req_id] += d.new_token_ids
    else:
        raise AssertionError("requests did not finish")
    worker.execute(sched.schedule())  # deliver the last drops
    assert worker.reqs == {} and not sched.has_pending_finished()
    assert sched.block_manager.num_free_gpu_blocks == sched.block_manager.num_gpu_blocks
    return dict(streamed)


# -- continuous batching and budgets ------------------------------------------------------------


def test_continuous_batching_admits_as_slots_free() -> None:
    sched, worker = make(num_gpu_blocks=10, max_num_seqs=2)
    sched.add_request(request("a", 5, max_tokens=3))
    sched.add_request(request("b", 3, max_tokens=2))
    sched.add_request(request("c", 2, max_tokens=1))

    plan, deltas = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 5, "b": 3}
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in plan.new_requests] == [
        ("a", [0, 1], 0),
        ("b", [2], 0),
    ]
    assert [d.req_id for d in deltas] == ["a", "b"]
    assert sched.num_running == 2 and sched.num_waiting == 1

    plan, deltas = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert plan.cached_requests == []  # both tables still have room: nothing to send
    assert [(d.req_id, d.finished, d.finish_reason) for d in deltas] == [
        ("a", False, None),
        ("b", True, "length"),
    ]
    assert sched.block_manager.free_gpu_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2]

    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["b"]
    assert plan.num_scheduled_tokens == {"a": 1, "c": 2}
    assert plan.new_requests[0].block_ids == [3]


def test_token_budget_chunks_the_request_that_does_not_fit() -> None:
    sched, worker = make(num_gpu_blocks=10, max_num_batched_tokens=8)
    sched.add_request(request("a", 6))
    sched.add_request(request("b", 6))
    plan, deltas = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 6, "b": 2}
    assert [d.req_id for d in deltas] == ["a"]  # b is mid-prefill: no token yet
    assert plan.new_requests[1].block_ids == [2]  # blocks only for the scheduled tokens
    plan, deltas = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4}
    assert [(c.req_id, c.new_block_ids) for c in plan.cached_requests] == [("b", [3])]
    assert [d.req_id for d in deltas] == ["a", "b"]
    assert sched.stats().num_chunked_prefill_steps == 1


def test_chunked_prefill_of_a_long_prompt_across_steps() -> None:
    sched, worker = make(num_gpu_blocks=16, max_num_batched_tokens=8)
    sched.add_request(request("long", 20, max_tokens=2))
    per_step = [step(sched, worker)[0].num_scheduled_tokens["long"] for _ in range(4)]
    assert per_step == [8, 8, 4, 1]
    assert not sched.has_unfinished_requests()
    assert sched.stats().num_chunked_prefill_steps == 2


def test_long_prefill_threshold_interleaves_with_decodes() -> None:
    sched, worker = make(
        num_gpu_blocks=16, max_num_batched_tokens=100, long_prefill_token_threshold=5
    )
    sched.add_request(request("a", 3, max_tokens=10))
    step(sched, worker)
    sched.add_request(request("long", 12, max_tokens=1))
    plans = [step(sched, worker)[0].num_scheduled_tokens for _ in range(3)]
    assert plans == [{"a": 1, "long": 5}, {"a": 1, "long": 5}, {"a": 1, "long": 2}]
    assert sched.get_request("long") is None  # finished: one token after the last chunk


def test_prompt_tokens_beside_decodes_are_capped_and_a_step_without_decodes_is_not() -> None:
    sched, worker = make(
        num_gpu_blocks=40, max_num_batched_tokens=12, max_prefill_tokens_with_decodes=5
    )
    sched.add_request(request("a", 8, max_tokens=10))
    sched.add_request(request("b", 6, max_tokens=10))
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 8, "b": 4}  # no decode yet: the whole budget
    sched.add_request(request("c", 9, max_tokens=10))
    plans = [step(sched, worker)[0].num_scheduled_tokens for _ in range(4)]
    assert plans == [
        {"a": 1, "b": 2, "c": 3},  # b's chunk and c's share the 5 beside a's decode
        {"a": 1, "b": 1, "c": 5},
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1},
    ]
    stats = sched.stats()
    assert stats.num_chunked_prefill_steps == 3


def test_max_num_seqs_and_no_overtaking() -> None:
    sched, worker = make(num_gpu_blocks=4, block_size=4, max_num_seqs=3)
    sched.add_request(request("a", 8))  # 2 blocks (+1 later)
    sched.add_request(request("big", 12, max_tokens=4))  # 3 blocks: does not fit next to a
    sched.add_request(request("small", 1))  # would fit, but must not overtake big
    plan, _ = step(sched, worker)
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert [r.req_id for r in sched.waiting] == ["big", "small"]


# -- preemption ---------------------------------------------------------------------------------


def _two_requests_filling_the_pool(mode: str, num_cpu_blocks: int) -> tuple[Scheduler, FakeWorker]:
    """a and b, prompt 3 each, block_size 2: [0, 1] and [2, 3]; the pool is full after two
    steps, and at step 2 a needs a third block."""
    sched, worker = make(
        num_gpu_blocks=4, num_cpu_blocks=num_cpu_blocks, block_size=2, preemption_mode=mode
    )
    sched.add_request(request("a", 3, max_tokens=4))
    sched.add_request(request("b", 3, max_tokens=4))
    plan, _ = step(sched, worker)
    assert [r.block_ids for r in plan.new_requests] == [[0, 1], [2, 3]]
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    return sched, worker


def test_preempt_newest_by_recompute() -> None:
    sched, worker = _two_requests_filling_the_pool("recompute", num_cpu_blocks=0)
    b = sched.get_request("b")
    assert b is not None and b.output_token_ids == reference_output(b.prompt_token_ids, 2)

    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["b"]
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.cached_requests[0].new_block_ids == [3]  # b's blocks came back tail-first
    assert plan.swap_out == [] and plan.new_requests == []
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert [r.req_id for r in sched.waiting] == ["b"]
    assert sched.block_manager.free_gpu_block_ids() == [2]

    plan, _ = step(sched, worker)  # a: 6 tokens fit in 3 blocks; b needs 3, one is free
    assert plan.num_scheduled_tokens == {"a": 1}
    assert sched.get_request("a") is None

    plan, _ = step(sched, worker)  # a's blocks freed tail-first after the free [2]
    assert plan.finished_req_ids == ["a"]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in plan.new_requests] == [
        ("b", [2, 3, 1], 0)
    ]
    assert plan.new_requests[0].output_token_ids == b.output_token_ids[:2]
    assert plan.num_scheduled_tokens == {"b": 5}  # prompt + both outputs recomputed
    stats = sched.stats()
    assert (stats.num_preemptions_recompute, stats.num_preemptions_swap) == (1, 0)
    assert run_all(sched, worker)["b"] == reference_output(b.prompt_token_ids, 4)[3:]
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 4)


def test_preempt_newest_by_swap_and_resume_in_full() -> None:
    sched, worker = _two_requests_filling_the_pool("swap", num_cpu_blocks=4)
    b = sched.get_request("b")
    assert b is not None

    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["b"]
    assert plan.swap_out == [BlockMove(2, 0), BlockMove(3, 1)]
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.cached_requests[0].new_block_ids == [3]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 4
    assert sched.block_manager.get_cpu_block_ids("b") == [0, 1]

    plan, _ = step(sched, worker)  # b needs 2 blocks back + 1 for its next slot; 1 is free
    assert plan.num_scheduled_tokens == {"a": 1} and plan.swap_in == []

    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["a"]
    assert plan.swap_in == [BlockMove(0, 2), BlockMove(1, 3)]
    [resumed] = plan.new_requests
    assert (resumed.req_id, resumed.block_ids, resumed.num_computed_tokens) == ("b", [2, 3, 1], 4)
    assert resumed.prompt_token_ids == b.prompt_token_ids
    assert resumed.output_token_ids == b.output_token_ids[:2]
    assert plan.num_scheduled_tokens == {"b": 1}  # only the token sampled before the swap
    assert sched.block_manager.free_cpu_block_ids() == [2, 3, 1, 0]
    stats = sched.stats()
    assert (stats.num_preemptions_swap, stats.num_swapped_out_blocks) == (1, 2)
    assert stats.num_swapped_in_blocks == 2
    run_all(sched, worker)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 4)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full() -> None:
    sched, worker = _two_requests_filling_the_pool("swap", num_cpu_blocks=1)
    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["b"] and plan.swap_out == []
    assert [r.req_id for r in sched.waiting] == ["b"] and sched.num_swapped == 0
    assert sched.stats().num_preemptions_recompute == 1


def test_request_preempts_itself_when_it_is_the_newest() -> None:
    sched, worker = make(num_gpu_blocks=4, block_size=2)
    sched.add_request(request("a", 3, max_tokens=2))  # [0, 1], room for one more token
    sched.add_request(request("b", 4, max_tokens=2))  # [2, 3], full
    step(sched, worker)
    plan, _ = step(sched, worker)  # b needs a third block: it is the newest, so b goes
    assert plan.finished_req_ids == ["b"]
    assert plan.num_scheduled_tokens == {"a": 1} and plan.cached_requests == []


def test_two_victims_in_one_step_return_oldest_first() -> None:
    sched, worker = make(num_gpu_blocks=3, block_size=2)
    for name in "abc":
        sched.add_request(request(name, 2, max_tokens=3))  # one full block each: [0], [1], [2]
    step(sched, worker)
    plan, _ = step(sched, worker)
    # a needs a second block: c (newest) goes and a takes its block; then b needs a second
    # block, and b is now the newest running request, so it preempts itself.
    assert plan.finished_req_ids == ["c", "b"]
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.cached_requests[0].new_block_ids == [2]
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    assert sched.stats().num_preemptions_recompute == 2


def test_no_admission_in_a_step_that_preempted() -> None:
    sched, worker = make(num_gpu_blocks=4, block_size=2, long_prefill_token_threshold=2)
    sched.add_request(request("a", 2, max_tokens=5))
    sched.add_request(request("b", 2, max_tokens=5))
    for _ in range(3):
        step(sched, worker)  # a: [0, 2], b: [1, 3], both full, five tokens each
    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["b"] and plan.cached_requests[0].new_block_ids == [3]
    # b's first chunk (2 tokens) would fit in the free block, but not in this step.
    assert plan.new_requests == [] and plan.num_scheduled_tokens == {"a": 1}
    assert sched.block_manager.free_gpu_block_ids() == [1]
    plan, _ = step(sched, worker)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 2}


def test_swap_victims_resume_oldest_first_and_block_admission() -> None:
    sched, worker = make(num_gpu_blocks=3, num_cpu_blocks=4, block_size=2, preemption_mode="swap")
    for name in "abc":
        sched.add_request(request(name, 2, max_tokens=3))  # [0], [1], [2]
    step(sched, worker)
    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["c", "b"]
    assert plan.swap_out == [BlockMove(2, 0), BlockMove(1, 1)]
    assert [r.req_id for r in sched.swapped] == ["b", "c"]
    assert sched.block_manager.free_gpu_block_ids() == [1]

    sched.add_request(request("d", 1, max_tokens=1))  # would fit in the free block
    plan, _ = step(sched, worker)  # b needs 2 blocks back: no resume, and d must wait too
    assert plan.num_scheduled_tokens == {"a": 1}
    assert sched.get_request("a") is None and sched.num_waiting == 1

    plan, _ = step(sched, worker)  # a's blocks came back: free queue [1, 2, 0]
    assert plan.finished_req_ids == ["a"]
    assert plan.swap_in == [BlockMove(1, 1)]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in plan.new_requests] == [
        ("b", [1, 2], 2)
    ]
    assert plan.num_scheduled_tokens == {"b": 1}  # c needs 2 blocks, one is free; d waits
    assert [r.req_id for r in sched.swapped] == ["c"] and sched.num_waiting == 1
    run_all(sched, worker)


# -- token accounting ---------------------------------------------------------------------------

WORKLOAD = [("r0", 7, 12), ("r1", 3, 20), ("r2", 16, 5), ("r3", 1, 15), ("r4", 9, 9), ("r5", 5, 1)]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize(
    ("num_gpu_blocks", "block_size", "budget", "threshold", "max_num_seqs", "prompt_cap"),
    [
        (100, 4, 512, None, 64, None),
        (10, 4, 16, None, 64, None),
        (7, 4, 8, 3, 3, None),
        (13, 2, 6, 4, 4, None),
        (100, 4, 16, None, 64, 1),  # chunks beside decodes one token at a time
        (10, 4, 16, None, 64, 5),
    ],
)
def test_outputs_match_an_unconstrained_run(
    prefix_caching: bool,
    mode: str,
    num_gpu_blocks: int,
    block_size: int,
    budget: int,
    threshold: int | None,
    max_num_seqs: int,
    prompt_cap: int | None,
) -> None:
    sched, worker = make(
        num_gpu_blocks,
        num_cpu_blocks=6,
        block_size=block_size,
        prefix_caching=prefix_caching,
        preemption_mode=mode,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        max_num_seqs=max_num_seqs,
        max_prefill_tokens_with_decodes=prompt_cap,
    )
    reqs = [request(name, p, m) for name, p, m in WORKLOAD]
    for r in reqs:
        sched.add_request(r)
    streamed = run_all(sched, worker)
    for r in reqs:
        expected = reference_output(r.prompt_token_ids, r.sampling.max_tokens)
        assert r.output_token_ids == expected, r.req_id
        assert streamed[r.req_id] == expected, r.req_id
        assert r.status is RequestStatus.FINISHED_LENGTH
    if num_gpu_blocks < 100:  # the small pools force preemptions, in the mode asked for
        stats = sched.stats()
        assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions) > 0


# -- stop conditions ----------------------------------------------------------------------------


def scripted(outputs: dict[str, list[int]]) -> SampleFn:
    """Sample outputs[req_id][i] for the request's i-th output token."""
    prompt_len: dict[str, int] = {}

    def sample(req_id: str, context: list[int]) -> int:
        start = prompt_len.setdefault(req_id, len(context))
        return outputs[req_id][len(context) - start]

    return sample


def test_stop_conditions() -> None:
    eos = 2
    script = {
        "eos": [5, eos, 6],
        "ignore": [5, eos, 6],
        "stop_id": [5, 7, 6],
        "min": [eos, 7, eos, 6],
        "len": [5, 5, 5, 5],
        "model_len": [5] * 10,
        "eos_last": [5, eos],
    }
    sched, worker = make(32, sample=scripted(script), eos_token_ids=(eos,), max_model_len=8)
    for req in [
        request("eos", 2, max_tokens=3),
        request("ignore", 2, max_tokens=3, ignore_eos=True),
        request("stop_id", 2, max_tokens=3, stop_token_ids=(7,)),
        request("min", 2, max_tokens=4, min_tokens=3, stop_token_ids=(7,)),
        request("len", 2, max_tokens=4),
        request("model_len", 5, max_tokens=10),
        request("eos_last", 2, max_tokens=2),
    ]:
        sched.add_request(req)
    final: dict[str, RequestOutputDelta] = {}
    tokens: dict[str, list[int]] = defaultdict(list)
    while sched.has_unfinished_requests():
        for d in step(sched, worker)[1]:
            tokens[d.req_id] += d.new_token_ids
            if d.finished:
                final[d.req_id] = d
    summary = {k: (tokens[k], d.finish_reason, d.stop_reason) for k, d in final.items()}
    assert summary == {
        "eos": ([5, eos], "stop", None),
        "ignore": ([5, eos, 6], "length", None),
        "stop_id": ([5, 7], "stop", 7),
        "min": ([eos, 7, eos], "stop", None),
        "len": ([5, 5, 5, 5], "length", None),
        "model_len": ([5, 5, 5], "length", None),  # 5 + 3 == max_model_len
        "eos_last": ([5, eos], "length", None),  # max_tokens is checked first
    }


def test_logprobs_pass_through() -> None:
    sched, worker = make(8)
    sched.add_request(request("a", 2, max_tokens=1, logprobs=2))
    [delta] = step(sched, worker)[1]
    assert delta.logprobs == [SampledToken(delta.new_token_ids[0])]


# -- finishing from outside ---------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_drops_only_what_the_worker_knows() -> None:
    sched, worker = _two_requests_filling_the_pool("swap", num_cpu_blocks=4)
    step(sched, worker)  # b is swapped out to CPU [0, 1]; a holds [0, 1, 3]
    sched.add_request(request("w", 2, max_tokens=1))
    bm = sched.block_manager
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert bm.free_cpu_block_ids() == [2, 3, 1, 0] and sched.num_swapped == 0
    sched.finish_requests(["w", "nobody", "b"], RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert bm.free_gpu_block_ids() == [2, 3, 1, 0] and sched.num_running == 0
    assert sched.has_pending_finished() and not sched.has_unfinished_requests()
    plan = sched.schedule()
    # b was dropped by the plan that swapped it out; w never reached the worker.
    assert plan.finished_req_ids == ["a"] and plan.num_scheduled_tokens == {}
    worker.execute(plan)
    assert worker.reqs == {}


def test_abort_while_a_step_is_in_flight() -> None:
    sched, worker = make(num_gpu_blocks=8)
    sched.add_request(request("a", 3))
    sched.add_request(request("b", 3))
    plan = sched.schedule()
    result = worker.execute(plan)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    deltas = sched.update(plan, result)
    assert [d.req_id for d in deltas] == ["b"]
    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["a"] and list(plan.num_scheduled_tokens) == ["b"]


def test_stop_string_finish_is_stopped() -> None:
    sched, worker = make(num_gpu_blocks=8)
    sched.add_request(request("a", 3))
    step(sched, worker)
    a = sched.get_request("a")
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a is not None and a.finish_reason == "stop" and a.is_finished
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


# -- contract checks ----------------------------------------------------------------------------


def test_update_rejects_results_that_do_not_fit_the_plan() -> None:
    sched, worker = make(num_gpu_blocks=8, max_num_batched_tokens=2)
    sched.add_request(request("a", 3))
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 2}
    with pytest.raises(ValueError, match="before its prefill"):
        sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(1)}))
    with pytest.raises(ValueError, match="unscheduled"):
        sched.update(plan, StepResult(plan.step_id, {"x": SampledToken(1)}))
    with pytest.raises(ValueError, match="result for step"):
        sched.update(plan, StepResult(plan.step_id + 1))
    a = sched.get_request("a")
    assert a is not None and a.output_token_ids == []  # nothing applied
    assert sched.stats().num_computed_tokens == 0
    ahead = sched.schedule()  # the next step may be planned while this one runs ...
    assert ahead.num_scheduled_tokens == {"a": 1}
    with pytest.raises(RuntimeError, match="not updated"):
        sched.schedule()  # ... but not the one after
    with pytest.raises(RuntimeError, match="not the step awaiting"):
        sched.update(ahead, StepResult(ahead.step_id))  # results apply in plan order
    sched.update(plan, worker.execute(plan))
    worker.execute(ahead)
    with pytest.raises(ValueError, match="sampled no token"):
        sched.update(ahead, StepResult(ahead.step_id))


def test_add_request_rejects_what_can_never_finish() -> None:
    sched, _ = make(num_gpu_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        sched.add_request(request("long", 64))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        sched.add_request(request("big", 10, max_tokens=8))  # 17 slots > 16
    sched.add_request(request("fits", 10, max_tokens=7))  # 16 slots
    with pytest.raises(ValueError, match="already"):
        sched.add_request(request("fits", 1))
    with pytest.raises(ValueError):
        Request("empty", [], SamplingParams())


@pytest.mark.parametrize(
    "bad",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_model_len": 0},
        {"preemption_mode": "drop"},
        {"eos_token_ids": [2]},
        {"eos_token_ids": (-1,)},
        {"long_prefill_token_threshold": 0},
        {"max_prefill_tokens_with_decodes": 0},
    ],
)
def test_config_validation(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)  # type: ignore[arg-type]


def test_stats_snapshot() -> None:
    sched, worker = make(num_gpu_blocks=8, max_num_seqs=1)
    sched.add_request(request("a", 5))
    sched.add_request(request("b", 5))
    step(sched, worker)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (1, 1, 0)
    assert stats.gpu_kv_usage == pytest.approx(2 / 8) == sched.kv_usage
    assert stats.num_steps == 1 and stats.num_preemptions == 0


# -- random workloads ---------------------------------------------------------------------------


SHARED_PREFIX = [900 + i for i in range(10)]


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (some sharing a prompt prefix, some with n > 1, some ended by stop
    tokens), steps (sync, or async with the next plan run before the last is applied) and
    aborts; integrity after every rule, and every request or child that finishes carries
    exactly the reference tokens for its seed."""

    def __init__(self) -> None:
        super().__init__()
        self.sched, self.worker = make(4)
        self.next_id = 0
        self.streamed: dict[str, list[int]] = defaultdict(list)
        self.asked: dict[str, tuple[list[int], int, int | None, tuple[int, ...]]] = {}
        self.live: set[str] = set()  # client request ids (a parent for n > 1)
        self.async_scheduling = False
        # Plans the worker has run whose results are not applied yet (async scheduling: the
        # worker runs each plan when it is sent, the scheduler hears of it a step later).
        self.running: deque[tuple[StepPlan, StepResult]] = deque()

    @initialize(
        mode=st.sampled_from(["recompute", "swap"]),
        num_gpu_blocks=st.integers(4, 12),
        num_cpu_blocks=st.integers(0, 24),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 24),
        threshold=st.none() | st.integers(1, 8),
        max_num_seqs=st.integers(1, 5),
        prefix_caching=st.booleans(),
        async_scheduling=st.booleans(),
    )
    def setup(
        self,
        mode: str,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        budget: int,
        threshold: int | None,
        max_num_seqs: int,
        prefix_caching: bool,
        async_scheduling: bool,
    ) -> None:
        self.async_scheduling = async_scheduling
        self.sched, self.worker = make(
            num_gpu_blocks,
            num_cpu_blocks,
            block_size,
            prefix_caching=prefix_caching,
            preemption_mode=mode,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
            max_num_seqs=max_num_seqs,
        )

    @rule(
        prompt_len=st.integers(1, 12),
        max_tokens=st.integers(1, 10),
        shared=st.integers(0, 10),
        n=st.sampled_from([1, 1, 2, 3]),
        seed=st.none() | st.integers(0, 3),
        stops=st.booleans(),
    )
    def add(
        self, prompt_len: int, max_tokens: int, shared: int, n: int, seed: int | None, stops: bool
    ) -> None:
        self.next_id += 1
        req_id = f"q{self.next_id}"
        prompt = (SHARED_PREFIX[:shared] + [self.next_id * 20 + i for i in range(prompt_len)])[
            :prompt_len
        ]
        stop = MACHINE_STOP_IDS if stops else ()
        sp = SamplingParams(max_tokens=max_tokens, n=n, seed=seed, stop_token_ids=stop)
        req = Request(req_id, prompt, sp)
        self.asked[req_id] = (prompt, max_tokens, seed, stop)
        try:
            self.sched.add_request(req)
        except InvalidRequestError:
            bm = self.sched.block_manager
            assert (
                bm.num_blocks_for(prompt_len + max_tokens - 1) > bm.num_gpu_blocks
                or n > self.sched.config.max_num_seqs
            )
        else:
            self.live.add(req_id)

    def _send(self) -> None:
        plan = self.sched.schedule()
        self.sched.check_integrity()
        self.running.append((plan, self.worker.execute(plan)))

    @rule()
    def step(self) -> None:
        """Sync: schedule, run, update. Async: keep the next plan running while the previous
        one's result is applied."""
        if not self.running:
            self._send()
        if self.async_scheduling and len(self.running) == 1:
            self._send()
        plan, result = self.running.popleft()
        for d in self.sched.update(plan, result):
            self.streamed[d.req_id] += d.new_token_ids
            client = d.parent_id or d.req_id
            if d.finished:
                prompt, max_tokens, seed, stop = self.asked[client]
                seed = child_seed(seed, d.index) if d.parent_id else seed
                assert self.streamed[d.req_id] == reference_output(prompt, max_tokens, seed, stop)
            if d.all_finished:
                self.live.remove(client)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        children = [r.req_id for r in self.sched.live_requests(req_id)]
        if data.draw(st.booleans()) and len(children) > 1:  # abort one child only
            self.sched.finish_requests(children[0], RequestStatus.FINISHED_ABORTED)
            assert [r.req_id for r in self.sched.live_requests(req_id)] == children[1:]
            return
        self.live.remove(req_id)
        self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        assert self.sched.live_requests(req_id) == []
        assert not set(children) & self.sched.block_manager.request_ids()

    @invariant()
    def live_requests_are_tracked(self) -> None:
        assert all(self.sched.live_requests(r) for r in self.live)
        assert self.sched.has_unfinished_requests() == bool(self.live)

    @invariant()
    def integrity(self) -> None:
        self.sched.check_integrity()

    def teardown(self) -> None:
        for _ in range(1000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        while self.running:
            plan, result = self.running.popleft()
            assert self.sched.update(plan, result) == []  # every request had finished
        self.worker.execute(self.sched.schedule())
        assert self.worker.reqs == {} and not self.sched.has_unfinished_requests()
        self.sched.check_integrity()
        bm = self.sched.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase
