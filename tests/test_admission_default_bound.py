"""The default waiting bound queues a burst the workers would run at once (--max-num-seqs per
worker) whatever their KV pools hold: 256 simultaneous streams on an idle default control
plane all finish, none hears RESOURCE_EXHAUSTED (HTTP 429)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from protos.v1 import worker_pb2, worker_pb2_grpc
from tests.procs import ServerProcess, free_port
from tests.stack import Stack, kv_bytes_for_blocks, request

BURST = 256  # --max-num-seqs' default: one batch


def start(spawn: Callable[..., ServerProcess], model: Path, pool: str) -> Stack:
    """A worker with the default pool, or one of 64 blocks (1,024 tokens: a few of the burst's
    requests at a time), under a control plane with every admission default."""
    wport = free_port()
    args = ["worker", "--model", str(model), "--port", str(wport), "--dtype", "float32"]
    if pool == "64 blocks":
        args += ["--kv-cache-memory", str(kv_bytes_for_blocks(model, 64, "float32"))]
    worker = spawn("worker", *args, "--swap-space", "0", ready_address=f"127.0.0.1:{wport}")
    cport = free_port()
    cp = spawn(
        "control-plane",
        "control-plane",
        "--port", str(cport),
        "--workers", worker.address,
        ready_address=f"127.0.0.1:{cport}",
    )  # fmt: skip
    return Stack(f"127.0.0.1:{cport}", [worker], cp)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("pool", ["default", "64 blocks"])
def test_a_burst_of_one_batch_is_queued_whatever_the_pool(
    spawn: Callable[..., ServerProcess], micro_llama: Path, pool: str
) -> None:
    stack = start(spawn, micro_llama, pool)
    if pool == "default":
        with grpc.insecure_channel(stack.worker.address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest())
        assert '"event": "kv_cache_sized"' in stack.worker.output()
        # A pool sized for the machine, reserved and not touched: no more than a small one.
        assert rss_bytes(stack.worker.proc.pid) < 900 << 20, info.kv_cache_bytes

    # The load: prompts of 32-256 tokens, all sent before any is read.
    rng = random.Random(0)
    calls = [
        stack.stub.Generate(
            request(
                [rng.randrange(1, 500) for _ in range(rng.randint(32, 256))],
                max_tokens=8,
                temperature=0.0,
                ignore_eos=True,
            ),
            timeout=300,
        )
        for _ in range(BURST)
    ]
    outcomes: list[str] = []
    for call in calls:
        try:
            tokens = sum(len(chunk.token_ids) for chunk in call)
            outcomes.append("ok" if tokens == 8 else f"{tokens} tokens")
        except grpc.RpcError as exc:
            outcomes.append(f"{exc.code().name}: {exc.details()}")
    refused = [o for o in outcomes if o != "ok"]
    assert not refused, f"{len(refused)} of {BURST}: {refused[:3]}"
