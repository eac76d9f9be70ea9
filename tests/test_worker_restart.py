"""A worker that dies mid-generation and comes back: the clients see no error and no repeated
token, and the output is still exactly transformers' greedy output."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.oracle import hf_greedy
from tests.procs import ServerProcess
from tests.stack import generate, greedy_to_length, start_stack, worker_cli_args


def test_worker_restart_mid_generation(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    max_tokens = 120
    expected = hf_greedy(micro_llama, prompts, [max_tokens] * len(prompts))
    # The requests wait for the restarted worker as long as it takes to start on a loaded
    # machine: past the failover timeout (10 s by default) they would fail, there being no
    # other worker to move to.
    stack = start_stack(
        spawn, micro_llama, dtype="float64", cp_args=("--worker-failover-timeout", "120")
    )
    epoch = stack.stats().workers[0].epoch

    def run(p: list[int]) -> list[int]:
        return greedy_to_length(stack.stub, p, max_tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p) for p in prompts]
        deadline = time.monotonic() + 30
        while stack.stats().workers[0].num_generated_tokens < 40:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        port = int(stack.worker.address.rsplit(":", 1)[1])
        stack.worker.proc.kill()
        stack.worker.proc.wait()
        spawn(
            "worker-restarted",
            *worker_cli_args(micro_llama, port, 256, 256, "float64"),
            ready_address=stack.worker.address,
        )
        outs = [f.result(timeout=120) for f in futures]

    assert outs == expected
    stats = stack.stats()
    assert stats.workers[0].epoch != epoch and stats.workers[0].healthy


def test_worker_lost_for_good_its_requests_move(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    max_tokens = 100
    expected = hf_greedy(micro_llama, prompts, [max_tokens] * len(prompts))
    stack = start_stack(
        spawn,
        micro_llama,
        dtype="float64",
        num_workers=2,
        cp_args=("--worker-failover-timeout", "1"),
    )

    def run(p: list[int]) -> list[int]:
        return greedy_to_length(stack.stub, p, max_tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p) for p in prompts]
        deadline = time.monotonic() + 30
        while min(w.num_generated_tokens for w in stack.stats().workers) < 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        lost = stack.workers[1]
        lost.proc.kill()
        lost.proc.wait()
        outs = [f.result(timeout=120) for f in futures]

    assert outs == expected
    by_address = {w.address: w for w in stack.stats().workers}
    assert not by_address[lost.address].healthy and by_address[stack.workers[0].address].healthy


def test_worker_restart_while_idle(spawn: Callable[..., ServerProcess], micro_llama: Path) -> None:
    stack = start_stack(spawn, micro_llama)
    first = generate(stack.stub, [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
    port = int(stack.worker.address.rsplit(":", 1)[1])
    stack.worker.proc.kill()
    stack.worker.proc.wait()
    spawn(
        "worker-restarted",
        *worker_cli_args(micro_llama, port, 256, 256, "float32"),
        ready_address=stack.worker.address,
    )
    # Until the control plane has reconnected, a request is refused at once (UNAVAILABLE).
    deadline = time.monotonic() + 30
    while not stack.stats().workers[0].healthy:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    again = generate(stack.stub, [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert again.token_ids == first.token_ids
