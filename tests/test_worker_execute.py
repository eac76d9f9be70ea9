"""The Worker contract over real gRPC, without a control plane: plans sent ahead are run in
order, a plan that contradicts the worker's state refuses the requests it names and the stream
goes on, one that does not decode ends the stream at once, and the next stream starts from
nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from pagedserve import wire
from pagedserve.plan import CachedRequestData, NewRequestData, StepPlan
from pagedserve.sampling_params import SamplingParams, StructuredOutput
from protos.v1 import worker_pb2, worker_pb2_grpc
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


def test_a_contradicting_plan_refuses_its_requests_and_the_stream_goes_on(
    stub: worker_pb2_grpc.WorkerStub,
) -> None:
    """A plan naming a request the worker does not hold is answered, not the end of the
    stream: the request is refused in the step's result, and the steps after it run."""
    plans = _plans()
    plans.insert(3, StepPlan(4, cached_requests=[CachedRequestData("nobody", [])]))
    plans[3].num_scheduled_tokens = {"nobody": 1}
    plans[4].step_id = 5
    results = list(stub.Execute(iter([wire.plan_to_proto(p) for p in plans]), timeout=60))
    assert [r.step_id for r in results] == [1, 2, 3, 4, 5]
    assert [f.req_id for f in results[3].refused] == ["nobody"]
    assert "nobody" in results[3].refused[0].message and not results[3].sampled
    assert [len(r.sampled) for r in results] == [1, 1, 1, 0, 1]
    assert _run(stub, _plans()) == [[s.token_id for s in r.sampled] for r in results if r.sampled]


def test_a_plan_that_does_not_decode_ends_its_stream_at_once(
    stub: worker_pb2_grpc.WorkerStub,
) -> None:
    """INVALID_ARGUMENT reaches the control plane while its side of the stream is still open
    (it would send the next plan): the worker does not wait for it to close first."""
    plans = [wire.plan_to_proto(p) for p in _plans()]
    plans[1].new_requests.add().CopyFrom(plans[0].new_requests[0])
    plans[1].new_requests[0].req_id = "bad"
    plans[1].new_requests[0].sampling.temperature = -1.0
    release, gave_up = threading.Event(), threading.Event()

    def held_open() -> Iterator[worker_pb2.StepPlan]:
        yield from plans[:2]
        if not release.wait(25):  # the control plane's side stays open meanwhile
            gave_up.set()

    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Execute(held_open(), timeout=100))
        assert not gave_up.is_set()  # the status came while the stream was open
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        release.set()
    assert len(_run(stub, _plans())) == 4  # the worker serves the next stream


def test_a_request_failed_by_its_grammar_leaves_the_plans_sent_ahead_valid(
    stub: worker_pb2_grpc.WorkerStub,
) -> None:
    """A schema the grammar library gives up on at its first token fails its request in the
    prefill's result; the decode steps sent before the control plane read it still name the
    request, and run (its rows are computed and dropped) beside another request's."""
    constrained = _new("g")
    constrained.sampling = SamplingParams(
        temperature=0.0, structured=StructuredOutput("json_schema", '{"$ref": "#"}')
    )
    constrained.block_ids = [2, 3]
    plans = _plans()
    plans[0].new_requests.append(constrained)
    plans[0].num_scheduled_tokens["g"] = len(PROMPT)
    for p in plans[1:]:
        p.cached_requests.append(CachedRequestData("g", []))
        p.num_scheduled_tokens["g"] = 1
    results = list(stub.Execute(iter([wire.plan_to_proto(p) for p in plans]), timeout=60))
    assert [r.step_id for r in results] == [1, 2, 3, 4]
    assert [f.req_id for f in results[0].failed] == ["g"]
    assert all(not r.failed and not r.refused for r in results[1:])
    assert [[s.req_id for s in r.sampled] for r in results] == [["a"]] * 4
    alone = _run(stub, _plans())
    assert [[s.token_id for s in r.sampled] for r in results] == alone


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
    it a CPU pool is sized from the host memory (tests/test_kv_pool_default.py)."""
    from gpu_worker import host_memory
    from gpu_worker.build import WorkerStartupError, _num_device_blocks
    from gpu_worker.config import WorkerConfig, default_kv_cache_memory
    from gpu_worker.kv_cache import CacheGeometry

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
        monkeypatch.setattr(host_memory, "available_bytes", lambda: 8 << 30)
        assert _num_device_blocks(default, whole, rank, None, 4) == (  # type: ignore[arg-type]
            default_kv_cache_memory(8 << 30) // whole.bytes_per_block
        )
