"""Liveness that tells the truth: a worker that dies idle, one that hangs mid-step, workers that
come up late or never. Real worker, control-plane and gateway processes."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gateway_stack import gateway_process
from tests.oracle import hf_greedy
from tests.procs import STARTUP_S, ServerProcess, free_port
from tests.stack import Stack, generate, greedy_to_length, start_stack, worker_cli_args

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until check() holds; fails the test after timeout."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


def kill(proc: ServerProcess) -> None:
    proc.proc.kill()
    proc.proc.wait()


def test_worker_dead_while_idle_is_noticed(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    stack = start_stack(spawn, micro_llama)
    gw = gateway_process(stack.address)
    url = gw.url
    try:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        generate(stack.stub, [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        kill(stack.worker)
        # Noticed although no request is running (within seconds on a quiet machine).
        wait_for(lambda: not stack.stats().workers[0].healthy, 60, "stats: worker unhealthy")
        wait_for(lambda: health_status(stack.address) == NOT_SERVING, 60, "gRPC health")
        assert health_status(stack.address, "liveness") == SERVING  # the process still runs
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert re.search(r"^pagedserve:num_healthy_workers(\{.*\})? 0\.0$", metrics, re.M)
        # The next request is refused at once, not after waiting for a worker (30 s).
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and time.monotonic() - start < 15, r.text
        assert r.headers["retry-after"]
    finally:
        gw.stop()


def test_placement_never_picks_a_worker_that_died_idle(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    # A failover timeout longer than the requests take even on a busy machine: one placed on
    # the dead worker would wait it out.
    failover_s = 120
    cp_args = ("--worker-failover-timeout", str(failover_s))
    stack = start_stack(spawn, micro_llama, num_workers=2, dtype="float64", cp_args=cp_args)
    dead = stack.workers[1]
    kill(dead)
    wait_for(
        lambda: [w.healthy for w in stack.stats().workers] == [True, False], 60, "one unhealthy"
    )
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(20)] for _ in range(6)]
    expected = hf_greedy(micro_llama, prompts, [8] * len(prompts))
    start = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: greedy_to_length(stack.stub, p, 8), prompts))
    assert outs == expected
    # None waited out a failover timeout on the dead worker.
    assert time.monotonic() - start < failover_s
    by_address = {w.address: w for w in stack.stats().workers}
    assert by_address[dead.address].num_generated_tokens == 0


def test_hung_worker_fails_over_and_its_late_results_are_dropped(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    max_tokens = 80
    expected = hf_greedy(micro_llama, prompts, [max_tokens] * len(prompts))
    stack = start_stack(
        spawn,
        micro_llama,
        dtype="float64",
        num_workers=2,
        cp_args=("--worker-failover-timeout", "2"),
    )
    hung = stack.workers[1]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(greedy_to_length, stack.stub, p, max_tokens) for p in prompts]
        wait_for(
            lambda: min(w.num_generated_tokens for w in stack.stats().workers) >= 16,
            300,
            "both workers generating",
        )
        os.kill(hung.proc.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            # Every stream ends although the stopped worker never answers.
            outs = [f.result(timeout=600) for f in futures]
            took = time.monotonic() - stopped
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
    # Exactly the greedy continuation: no token lost, none twice.
    assert outs == expected
    assert took < 300  # after the 2 s failover, however slowly the other worker computes
    # Once it answers again it is taken back, and serves.
    wait_for(lambda: all(w.healthy for w in stack.stats().workers), 120, "taken back")
    again = [greedy_to_length(stack.stub, p, 8) for p in prompts]
    assert again == [e[:8] for e in expected]


def test_control_plane_serves_with_the_workers_it_has(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    first_port, late_port, cp_port = free_port(), free_port(), free_port()
    spawn(
        "worker-0",
        *worker_cli_args(micro_llama, first_port, 256, 256, "float32"),
        ready_address=f"127.0.0.1:{first_port}",
    )
    late = f"127.0.0.1:{late_port}"
    start = time.monotonic()
    cp = spawn(
        "control-plane",
        "control-plane",
        "--port", str(cp_port),
        "--workers", f"127.0.0.1:{first_port},{late}",
        ready_address=f"127.0.0.1:{cp_port}",
    )  # fmt: skip
    assert time.monotonic() - start < 150  # not the 300 s --worker-connect-timeout
    stack = Stack(cp.address, [], cp)
    out = generate(stack.stub, [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(out.token_ids) == 4
    assert late in cp.output() and "waiting_for_workers" in cp.output()
    assert [w.address for w in stack.stats().workers] == [f"127.0.0.1:{first_port}"]
    worker = spawn(
        "worker-late",
        *worker_cli_args(micro_llama, late_port, 256, 256, "float32"),
        ready_address=late,
    )
    wait_for(lambda: len(stack.stats().workers) == 2, 120, "the late worker registered")
    assert all(w.healthy for w in stack.stats().workers)
    assert worker.proc.poll() is None


def test_control_plane_without_workers_exits_with_one_clear_line(micro_llama: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "control-plane", "--port", str(free_port()),
        "--workers", nowhere, "--worker-connect-timeout", "2",
    ]  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert time.monotonic() - start < 150  # its 2 s, not the default 300 s
    assert "Traceback" not in out.stderr + out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert nowhere in last and "--worker-connect-timeout" in last, out.stderr


@pytest.mark.parametrize("answer", ["Generate", "ListModels", "Tokenize", "Detokenize"])
def test_requests_before_any_worker_get_unavailable(
    spawn: Callable[..., ServerProcess], answer: str
) -> None:
    """With --worker-wait-timeout 0 they are refused at once (tests/test_worker_readiness.py
    has the wait)."""
    nowhere = f"127.0.0.1:{free_port()}"
    cp_port = free_port()
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "control-plane", "--port", str(cp_port),
        "--workers", nowhere, "--worker-wait-timeout", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{cp_port}"
        wait_for(lambda: _liveness(address), STARTUP_S, "control plane up")
        assert health_status(address) == NOT_SERVING
        from protos.v1 import control_plane_pb2 as pb
        from protos.v1 import control_plane_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ControlPlaneStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                if answer == "Generate":
                    list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=5))
                elif answer == "Tokenize":
                    stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5)
                elif answer == "Detokenize":
                    stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), timeout=5)
                else:
                    stub.ListModels(pb.ListModelsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker is ready" in err.value.details() and nowhere in err.value.details()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)


def _liveness(address: str) -> bool:
    try:
        return health_status(address, "liveness") == SERVING
    except grpc.RpcError:
        return False
