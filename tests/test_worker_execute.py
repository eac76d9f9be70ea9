"""The Worker contract over real gRPC, without a control plane: plans sent ahead are run in
order, a plan that contradicts the worker's state ends the stream with INVALID_ARGUMENT, and
the next stream starts from nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from pagedserve import wire
from pagedserve.plan import CachedRequestData, NewRequestData, StepPlan
from pagedserve.sampling_params import SamplingParams
from protos.v1 import worker_pb2_grpc
from tests.procs import ServerProcess, free_port
from tests.stack import worker_cli_args

PROMPT = list(range(5, 25))  # 20 tokens: blocks 0 and 1 of 16


def _new(req_id: str) -> NewRequestData:
    return NewRequestData(req_id, PROMPT, [], SamplingParams(temperature=0.0), [0, 1], 0)


def _plans() -> list[StepPlan]:
    """Prefill, then three decode steps, as a control plane sends them one ahead."""
    plans = [StepPlan(1, new_requests=[_new("a")], num_scheduled_tokens={"a": len(PROMPT)})]
    for step in range(2, 5):
        cached = [CachedRequestData("a", [])]
        plans.append(StepPlan(step, cached_requests=cached, num_scheduled_tokens={"a": 1}))
    return plans


@pytest.fixture(scope="module")
def stub(
    module_spawn: Callable[..., ServerProcess], micro_llama: Path
) -> worker_pb2_grpc.WorkerStub:
    port = free_port()
    args = worker_cli_args(micro_llama, port, 8, 0, "float32")
    worker = module_spawn("worker", *args, ready_address=f"127.0.0.1:{port}")
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))


def _run(stub: worker_pb2_grpc.WorkerStub, plans: list[StepPlan]) -> list[list[int]]:
    results = stub.Execute(iter([wire.plan_to_proto(p) for p in plans]), timeout=60)
    return [[s.token_id for s in r.sampled] for r in results]


def test_plans_sent_ahead_run_in_order_and_a_new_stream_starts_afresh(
    stub: worker_pb2_grpc.WorkerStub,
) -> None:
    first = _run(stub, _plans())
    assert len(first) == 4 and all(len(t) == 1 for t in first)
    # The same request id again: the worker forgot the first stream's state.
    assert _run(stub, _plans()) == first


def test_a_contradicting_plan_ends_the_stream_with_invalid_argument(
    stub: worker_pb2_grpc.WorkerStub,
) -> None:
    plans = _plans()
    plans[2] = StepPlan(3, cached_requests=[CachedRequestData("nobody", [])])
    plans[2].num_scheduled_tokens = {"nobody": 1}
    with pytest.raises(grpc.RpcError) as err:
        _run(stub, plans)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nobody" in (err.value.details() or "")
    assert len(_run(stub, _plans())) == 4  # the worker serves the next stream


def test_an_unused_swap_pool_takes_no_memory(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    """The host swap pool is reserved, not touched: with recompute preemption (the default) it
    costs nothing, whatever --swap-space says."""
    port = free_port()
    args = worker_cli_args(micro_llama, port, 64, 64, "float32")
    swap = args.index("--swap-space")
    args[swap + 1] = str(1 << 30)
    worker = spawn("worker", *args, ready_address=f"127.0.0.1:{port}")
    with open(f"/proc/{worker.proc.pid}/status") as f:
        rss = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    assert rss < 900 << 20, f"worker RSS {rss >> 20} MiB with an untouched 1 GiB swap pool"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_kv_pool_is_what_kv_cache_memory_holds_on_either_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit --kv-cache-memory sizes the pool on CUDA too (no profiling pass), as on CPU,
    and on CUDA a size that does not fit beside the weights is refused in one line; without
    it a CPU pool is 1 GiB."""
    from gpu_worker.config import DEFAULT_KV_CACHE_MEMORY, WorkerConfig
    from gpu_worker.kv_cache import CacheGeometry
    from gpu_worker.server import WorkerStartupError, _num_device_blocks

    whole = CacheGeometry(4, 4, 64, 16, torch.float32)
    rank = CacheGeometry(4, 2, 64, 16, torch.float32)  # one of two tensor-parallel ranks
    free = {"bytes": 10 * rank.bytes_per_block}  # what the "device" has left: 10 rank blocks
    if device == "cuda" and not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free["bytes"], 1 << 40))
    elif device == "cuda":
        free["bytes"] = torch.cuda.mem_get_info("cuda")[0]
    cfg = WorkerConfig(model="m", device=device, kv_cache_memory=10 * whole.bytes_per_block + 1)
    assert _num_device_blocks(cfg, whole, rank, None, 4) == 10  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_memory"):
        WorkerConfig(model="m", device=device, kv_cache_memory=0)
    if device == "cuda":
        too_big = WorkerConfig(
            model="m", device=device, kv_cache_memory=2 * (free["bytes"] + whole.bytes_per_block)
        )
        with pytest.raises(WorkerStartupError, match="--kv-cache-memory .* free after the"):
            _num_device_blocks(too_big, whole, rank, None, 4)  # type: ignore[arg-type]
    else:
        default = WorkerConfig(model="m")
        assert default.kv_cache_memory is None
        assert _num_device_blocks(default, whole, rank, None, 4) == (  # type: ignore[arg-type]
            DEFAULT_KV_CACHE_MEMORY // whole.bytes_per_block
        )
