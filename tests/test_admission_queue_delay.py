"""`--max-queue-delay`: the step-cost fit, the queue-delay estimate over a real scheduler's
backlog, and a real control plane refusing (429 / RESOURCE_EXHAUSTED at once) what would wait
too long, while what it admits runs to the end."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest

from control_plane.admission import StepCost, queue_delay
from control_plane.scheduler import Backlog, SchedulerConfig
from protos.v1 import control_plane_pb2 as pb
from tests.gateway_stack import gateway_process
from tests.procs import ServerProcess
from tests.stack import Stack, generate, start_stack
from tests.stack import request as generate_request
from tests.test_scheduler import make, request, step

T = TypeVar("T")

CFG = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=100, max_model_len=1024)
IDLE = Backlog(rows=0, prefill_tokens=0, seats=0, blocks_needed=0, free_blocks=1000)


def fitted(fixed: float, per_token: float, sizes: list[int], noise: float = 0.0) -> StepCost:
    rng = random.Random(0)
    cost = StepCost()
    for x in sizes:
        cost.observe(x, fixed + per_token * x + rng.uniform(-noise, noise))
    return cost


def test_step_cost_recovers_a_line_from_noisy_steps() -> None:
    rng = random.Random(1)
    sizes = [rng.choice([1, 8, 32, 200, 900]) for _ in range(400)]
    fixed, per_token = fitted(0.004, 2e-5, sizes, noise=5e-4).line()
    assert fixed == pytest.approx(0.004, abs=3e-4)
    assert per_token == pytest.approx(2e-5, rel=0.1)


def test_step_cost_follows_the_recent_steps() -> None:
    cost = fitted(0.010, 1e-5, [1, 50, 300] * 100)
    for x in [1, 50, 300] * 40:  # the batch changed: steps now cost twice as much
        cost.observe(x, 2 * (0.010 + 1e-5 * x))
    assert cost.seconds(50) == pytest.approx(2 * (0.010 + 1e-5 * 50), rel=0.05)


def test_step_cost_of_steps_all_one_size_is_their_mean() -> None:
    cost = fitted(0.006, 0.0, [16] * 50)
    assert cost.line() == pytest.approx((0.006, 0.0))
    assert StepCost().line() == (0.0, 0.0)  # nothing measured: nothing to wait for


def test_an_idle_worker_adds_no_delay() -> None:
    cost = fitted(0.005, 1e-4, [1, 10, 100] * 20)
    assert queue_delay(cost, CFG, IDLE, [], 0.0, 250, 1, 16) == 0.0


def test_the_delay_counts_steps_in_flight_prompts_ahead_and_running_rows() -> None:
    fixed, per_token = 0.005, 1e-4
    cost = fitted(fixed, per_token, [1, 10, 100] * 20)
    # Two plans in flight (the first half done), 150 prompt tokens queued, 20 rows decoding.
    backlog = Backlog(rows=20, prefill_tokens=150, seats=25, blocks_needed=10, free_blocks=100)
    delay = queue_delay(cost, CFG, backlog, [40, 30], 0.5 * (fixed + per_token * 40), 50, 1, 4)
    in_flight = 0.5 * (fixed + per_token * 40) + fixed + per_token * 30
    steps = math.ceil((150 + 50) / (100 - 20))  # 3 steps of 80 prompt tokens beside 20 rows
    shared = steps * fixed + per_token * (steps * 20 + 200)
    alone = fixed + per_token * 50
    assert delay == pytest.approx(in_flight + shared - alone)
    # More queued work never waits less.
    more = Backlog(rows=20, prefill_tokens=400, seats=25, blocks_needed=10, free_blocks=100)
    assert queue_delay(cost, CFG, more, [40, 30], 0.0, 50, 1, 4) > delay


def test_a_step_past_its_estimate_leaves_the_plans_behind_it_whole() -> None:
    fixed, per_token = 0.005, 1e-4
    cost = fitted(fixed, per_token, [1, 10, 100] * 20)
    # The oldest plan has run three times its estimate (a stalled step): the plan behind it
    # has not started, so its whole estimate is still ahead of a new request.
    first = fixed + per_token * 40
    second = fixed + per_token * 30
    delay = queue_delay(cost, CFG, IDLE, [40, 30], 3 * first, 50, 1, 4)
    assert delay == pytest.approx(second)
    # Half through the oldest: what is left of it, then the next.
    assert queue_delay(cost, CFG, IDLE, [40, 30], 0.5 * first, 50, 1, 4) == pytest.approx(
        0.5 * first + second
    )


def test_no_seat_or_no_blocks_is_an_unbounded_wait() -> None:
    cost = fitted(0.005, 1e-4, [1, 10, 100] * 20)
    seats_full = Backlog(rows=31, prefill_tokens=0, seats=31, blocks_needed=0, free_blocks=100)
    assert queue_delay(cost, CFG, seats_full, [], 0.0, 10, 1, 1) < math.inf
    assert queue_delay(cost, CFG, seats_full, [], 0.0, 10, 2, 1) == math.inf  # n = 2
    short = Backlog(rows=1, prefill_tokens=40, seats=2, blocks_needed=90, free_blocks=100)
    assert queue_delay(cost, CFG, short, [], 0.0, 40, 1, 10) < math.inf
    assert queue_delay(cost, CFG, short, [], 0.0, 48, 1, 12) == math.inf


def test_the_backlog_is_what_the_scheduler_holds() -> None:
    sched, worker = make(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16)
    sched.add_request(request("a", 10, max_tokens=20))
    sched.add_request(request("b", 30, max_tokens=20))
    sched.add_request(request("c", 7, max_tokens=20, n=3))
    step(sched, worker)  # a: 10 prompt tokens, b: 6 of its 30
    b = sched.backlog()
    assert b.rows == 2  # a decodes, b is mid-prefill
    # b's rest (its last token comes with its row), and c's prompt but the last token, which
    # each of its 3 children computes itself.
    assert b.prefill_tokens == (30 - 6 - 1) + 6
    assert b.seats == 1 + 1 + 3
    assert b.blocks_needed == 2  # c's 7 prompt tokens in blocks of 4
    assert b.free_blocks == 64 - 3 - 2  # a holds 3 blocks (10 tokens + 1), b 2


def when_idle(stack: Stack, call: Callable[[], T | None]) -> T:
    """What call() gives on an idle worker (None: refused). A request that has just ended may
    have a plan still in flight, sent ahead before its last token came back; the worker
    computes it before anything else, so a tight bound refuses what comes meanwhile. After a
    refusal, call() again once the worker has answered a step more."""
    for _ in range(3):
        steps = stack.stats().workers[0].num_steps
        out = call()
        if out is not None:
            return out
        while stack.stats().workers[0].num_steps == steps:
            time.sleep(0.01)
    raise AssertionError("an idle worker refused three times")


def unless_refused(call: Callable[[], T]) -> Callable[[], T | None]:
    """call, with RESOURCE_EXHAUSTED as None."""

    def attempt() -> T | None:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return None

    return attempt


def test_a_tight_bound_refuses_at_once_and_runs_what_it_admits(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    """With a bound below any step, a request that finds a row decoding is refused: the
    prompt tokens a step may carry beside decodes (--max-prefill-tokens-with-decodes) are fewer
    than its prompt, so it would take a step more than alone, whatever the fitted step costs.
    It hears RESOURCE_EXHAUSTED naming the flag, an HTTP client 429 with Retry-After; what was
    admitted finishes, and an idle worker admits again. Only the order of events matters, not
    how fast the machine is: each request is sent once the one it depends on is where it must
    be."""
    cp_args = ("--max-queue-delay", "0.000001", "--max-prefill-tokens-with-decodes", "32")
    stack = start_stack(spawn, micro_llama, cp_args=cp_args)
    stub = stack.stub
    generate(stub, [5, 6, 7], max_tokens=8, temperature=0.0, ignore_eos=True)  # steps measured

    def refusal(i: int) -> None:
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, [5 + i] * 40, max_tokens=150, temperature=0.0, ignore_eos=True)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "--max-queue-delay" in (info.value.details() or ""), info.value.details()

    def post(max_tokens: int) -> httpx.Response:
        body = {"prompt": [9] * 40, "max_tokens": max_tokens, "ignore_eos": True}
        return httpx.post(f"{gw.url}/v1/completions", json=body, timeout=300)

    def start_running() -> tuple[pb.GenerateResponse, Iterator[pb.GenerateResponse]]:
        ask = generate_request([5] * 40, max_tokens=150, temperature=0.0, ignore_eos=True)
        running = stub.Generate(ask, timeout=300)
        return next(running), running

    def served_over_http() -> httpx.Response | None:
        r = post(8)
        return None if r.status_code == 429 else r

    gw = gateway_process(stack.address)
    try:
        # Admitted by an idle worker. Its first token is out, so its row decodes for 149 steps
        # more while the others ask (each is answered before the first step it would join, and
        # a refusal takes no step at all).
        first, running = when_idle(stack, unless_refused(start_running))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(refusal, range(8)))
            responses = list(pool.map(post, [150] * 8))
        for r in responses:
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert "--max-queue-delay" in r.json()["error"]["message"]
        rest = list(running)
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 150
        assert rest[-1].finish_reason == "length"
        # Idle again: admitted, over gRPC and over HTTP.
        again = when_idle(
            stack,
            unless_refused(lambda: generate(stub, [5] * 40, max_tokens=4, temperature=0.0)),
        )
        assert again.finish_reason
        r = when_idle(stack, served_over_http)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        gw.stop()


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bound_that_is_not_seconds_is_refused_at_start(value: str) -> None:
    cmd = [sys.executable, "-m", "pagedserve.cli", "control-plane", "--workers", "127.0.0.1:1"]
    out = subprocess.run(
        [*cmd, "--max-queue-delay", value], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert f"--max-queue-delay: must be seconds > 0 or off, got {value}" in out.stderr
    assert "Traceback" not in out.stderr
