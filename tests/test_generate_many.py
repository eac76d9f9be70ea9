"""GenerateMany over real gRPC: many requests on one call, answered in batches, each the same
as its own Generate call would be; refusals, aborts and a dropped call end only what they
name."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from protos.v1 import control_plane_pb2 as pb
from tests.procs import ServerProcess
from tests.stack import Stack, generate, request, start_stack, wait_all_free

NUM_GPU_BLOCKS = 64


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess], micro_llama: Path) -> Stack:
    return start_stack(module_spawn, micro_llama, num_gpu_blocks=NUM_GPU_BLOCKS)


class ManyCall:
    """A GenerateMany call whose requests are sent as the test goes."""

    def __init__(self, stack: Stack) -> None:
        self._out: queue.Queue[pb.GenerateManyRequest | None] = queue.Queue()
        self.call = stack.stub.GenerateMany(self._requests(), timeout=300)

    def _requests(self) -> Iterator[pb.GenerateManyRequest]:
        while (msg := self._out.get()) is not None:
            yield msg

    def start(self, req: pb.GenerateRequest) -> None:
        self._out.put(pb.GenerateManyRequest(generate=req))

    def abort(self, req_id: str) -> None:
        self._out.put(pb.GenerateManyRequest(abort=req_id))

    def close_sending(self) -> None:
        self._out.put(None)


def collect(
    call: ManyCall, ids: set[str]
) -> tuple[dict[str, list[pb.GenerateResponse]], dict[str, pb.GenerateError], int]:
    """Every message of the requests `ids` until each has ended; also the number of batches."""
    messages: dict[str, list[pb.GenerateResponse]] = {i: [] for i in ids}
    errors: dict[str, pb.GenerateError] = {}
    open_ids, batches = set(ids), 0
    for batch in call.call:
        batches += 1
        for m in batch.responses:
            messages[m.request_id].append(m)
            if m.last:
                open_ids.discard(m.request_id)
        for e in batch.errors:
            errors[e.request_id] = e
            open_ids.discard(e.request_id)
        if not open_ids:
            break
    return messages, errors, batches


def test_many_requests_on_one_call_equal_their_own_calls(stack: Stack) -> None:
    prompts = {f"r{i}": list(range(5 + i, 25 + 3 * i)) for i in range(8)}
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = {rid: generate(stack.stub, p, **kw).token_ids for rid, p in prompts.items()}
    many = ManyCall(stack)
    for rid, p in prompts.items():
        many.start(request(p, request_id=rid, **kw))
    messages, errors, batches = collect(many, set(prompts))
    many.close_sending()
    assert errors == {}
    for rid, msgs in messages.items():
        assert [t for m in msgs for t in m.token_ids] == alone[rid]
        assert msgs[-1].finish_reason == "length" and msgs[-1].last
        assert not any(m.last for m in msgs[:-1])
        assert msgs[-1].completion_tokens == 24
    # One message per step for all the requests, not one per request per step.
    assert batches < sum(len(m) for m in messages.values()) / 2
    assert wait_all_free(stack, timeout=2.0).num_running == 0


def test_a_refused_request_is_an_error_entry_and_the_rest_go_on(stack: Stack) -> None:
    many = ManyCall(stack)
    many.start(request(list(range(5, 30)), request_id="ok", max_tokens=16, ignore_eos=True))
    many.start(request(list(range(5, 30)), request_id="huge", max_tokens=10**6))
    many.start(request([10**7], request_id="bad-id", max_tokens=4))
    messages, errors, _ = collect(many, {"ok", "huge", "bad-id"})
    many.close_sending()
    assert set(errors) == {"huge", "bad-id"}
    for e in errors.values():
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "maximum context length" in errors["huge"].message
    assert "vocab size" in errors["bad-id"].message
    assert sum(len(m.token_ids) for m in messages["ok"]) == 16
    assert messages["huge"] == [] and messages["bad-id"] == []


def test_a_duplicate_request_id_ends_both(stack: Stack) -> None:
    many = ManyCall(stack)
    kw = dict(max_tokens=500, temperature=0.0, ignore_eos=True)
    many.start(request(list(range(5, 50)), request_id="twice", **kw))
    many.start(request(list(range(6, 50)), request_id="twice", **kw))
    _, errors, _ = collect(many, {"twice"})
    many.close_sending()
    assert errors["twice"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already running" in errors["twice"].message
    assert wait_all_free(stack, timeout=2.0).workers[0].num_free_gpu_blocks == NUM_GPU_BLOCKS


def test_abort_on_the_call_frees_only_that_request(stack: Stack) -> None:
    many = ManyCall(stack)
    long = dict(max_tokens=900, temperature=0.0, ignore_eos=True)
    many.start(request(list(range(5, 105)), request_id="stays", max_tokens=40, ignore_eos=True))
    many.start(request(list(range(5, 105)), request_id="goes", **long))
    seen: dict[str, int] = {"stays": 0, "goes": 0}
    aborted = False
    for batch in many.call:
        for m in batch.responses:
            seen[m.request_id] += len(m.token_ids)
            assert m.request_id != "goes" or not m.last
        if seen["goes"] >= 3 and not aborted:
            many.abort("goes")
            aborted = True
        if any(m.request_id == "stays" and m.last for m in batch.responses):
            break
    many.close_sending()
    assert seen["stays"] == 40
    stats = wait_all_free(stack, timeout=2.0)
    assert stats.workers[0].num_free_gpu_blocks == NUM_GPU_BLOCKS and stats.num_running == 0


def test_a_dropped_call_aborts_every_request_on_it(stack: Stack) -> None:
    many = ManyCall(stack)
    long = dict(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(2):
        many.start(request(list(range(5 + i, 25)), request_id=f"drop{i}", **long))
    streaming: set[str] = set()
    for batch in many.call:
        assert not batch.errors
        streaming.update(m.request_id for m in batch.responses)
        if len(streaming) == 2:
            break
    assert stack.stats().num_running == 2
    many.call.cancel()
    stats = wait_all_free(stack, timeout=2.0)
    assert stats.workers[0].num_free_gpu_blocks == NUM_GPU_BLOCKS and stats.num_running == 0


def test_the_call_ends_when_the_client_is_done_and_its_requests_are(stack: Stack) -> None:
    many = ManyCall(stack)
    many.start(request(list(range(5, 30)), request_id="only", max_tokens=5, ignore_eos=True))
    many.close_sending()
    done = threading.Event()
    got: list[pb.GenerateManyResponse] = []

    def read() -> None:
        got.extend(many.call)  # returns only when the server ends the call
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(30)
    tokens = [t for b in got for m in b.responses for t in m.token_ids]
    assert len(tokens) == 5 and got[-1].responses[-1].last
