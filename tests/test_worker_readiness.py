"""Requests that come before any worker has registered: they wait for one (at most
--worker-wait-timeout), over gRPC and through the gateway, and are served once it registers;
past the wait they get UNAVAILABLE, and the gateway 503 in OpenAI's shape. Real worker,
control-plane and gateway processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from protos.v1 import control_plane_pb2 as pb
from tests.gateway_stack import gateway_process
from tests.procs import ServerProcess, free_port
from tests.stack import Stack, request, worker_cli_args

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial

PROMPT = [5, 6, 7]


def control_plane_without_worker(
    spawn: Callable[..., ServerProcess], worker: str, *args: str
) -> Stack:
    """A control plane listening with `worker` listed but not (yet) up."""
    port = free_port()
    cp = spawn(
        "control-plane",
        "control-plane",
        "--port", str(port),
        "--workers", worker,
        *args,
        ready_address=f"127.0.0.1:{port}",
        ready_service="liveness",
    )  # fmt: skip
    return Stack(cp.address, [], cp)


def test_requests_before_the_worker_wait_and_complete_once_it_registers(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    worker_port = free_port()
    worker = f"127.0.0.1:{worker_port}"
    # Longer than a worker takes to start on a busy machine (minutes at a load of 25), and
    # than any wait below may take, so that a wait that is not cut short shows as one.
    wait_s = 600
    stack = control_plane_without_worker(spawn, worker, "--worker-wait-timeout", str(wait_s))
    gw = gateway_process(stack.address)
    try:
        # The client's own deadline ends its wait.
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stack.stub.Generate(request(PROMPT, max_tokens=2), timeout=0.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < wait_s / 4
        # /metrics and /health do not wait.
        start = time.monotonic()
        assert httpx.get(f"{gw.url}/metrics", timeout=60).status_code == 200
        assert httpx.get(f"{gw.url}/health", timeout=60).status_code == 503
        assert time.monotonic() - start < wait_s / 4
        assert stack.stats().workers == []

        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(3) as pool:
            ask = request(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
            grpc_out = pool.submit(lambda: list(stack.stub.Generate(ask, timeout=wait_s)))
            http_out = pool.submit(
                httpx.post, f"{gw.url}/v1/completions", json=body, timeout=wait_s
            )
            models = pool.submit(httpx.get, f"{gw.url}/v1/models", timeout=wait_s)
            time.sleep(1.0)  # they wait (or have not been sent yet): none has an answer
            assert not (grpc_out.done() or http_out.done() or models.done())
            spawn(
                "worker",
                *worker_cli_args(micro_llama, worker_port, 64, 0, "float32"),
                ready_address=worker,
            )
            out = grpc_out.result(timeout=wait_s)
            r = http_out.result(timeout=wait_s)
            m = models.result(timeout=wait_s)
        assert out[-1].finish_reason == "length" and sum(len(c.token_ids) for c in out) == 4
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert m.status_code == 200 and m.json()["data"][0]["max_model_len"] > 0
        assert "request_rejected" not in stack.control_plane.output()
        assert [w.address for w in stack.stats().workers] == [worker]
    finally:
        gw.stop()


def test_past_the_wait_requests_get_unavailable_and_503(
    spawn: Callable[..., ServerProcess],
) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    stack = control_plane_without_worker(spawn, nowhere, "--worker-wait-timeout", "1")
    gw = gateway_process(stack.address)
    try:
        calls: dict[str, Callable[[], object]] = {
            "Generate": lambda: list(stack.stub.Generate(request(PROMPT), timeout=20)),
            "Tokenize": lambda: stack.stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=20),
            "ListModels": lambda: stack.stub.ListModels(pb.ListModelsRequest(), timeout=20),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            waited = time.monotonic() - start
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
            details = err.value.details()
            assert f"no worker is ready (waited 1 s for {nowhere}" in details, details
            assert "--worker-wait-timeout" in details
            assert 0.9 < waited < 60, (name, waited)  # its 1 s, not the default 30 s

        start = time.monotonic()
        r = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=20,
        )
        assert 0.9 < time.monotonic() - start < 60
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
        assert "no worker is ready" in error["message"]
    finally:
        gw.stop()
