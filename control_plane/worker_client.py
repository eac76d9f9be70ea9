"""The control plane's side of one worker: Describe, then one Execute stream for its life."""

from __future__ import annotations

import asyncio

import grpc

from pagedserve import wire
from pagedserve.plan import StepPlan, StepResult
from protos.v1 import worker_pb2, worker_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class WorkerError(RuntimeError):
    """The worker stream failed; every request on it must be failed or recomputed."""


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._call: grpc.aio.StreamStreamCall | None = None

    async def describe(self, timeout: float) -> worker_pb2.WorkerInfo:
        return await self.stub.Describe(
            worker_pb2.DescribeRequest(), timeout=timeout, wait_for_ready=True
        )

    async def send(self, plan: StepPlan) -> None:
        """Writes a plan to the Execute stream; its result is read with receive()."""
        try:
            if self._call is None:
                self._call = self.stub.Execute()
            await self._call.write(wire.plan_to_proto(plan))
        except grpc.aio.AioRpcError as exc:
            raise self._failed(f"{exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError as exc:  # the stream ended while we were idle
            raise self._failed("the Execute stream has ended") from exc

    async def receive(self, plan: StepPlan) -> StepResult:
        """Reads the result of the plan sent last."""
        if self._call is None:
            raise WorkerError(f"worker {self.address}: no plan is in flight")
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._failed(f"{exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError as exc:
            raise self._failed("the Execute stream has ended") from exc
        if msg is grpc.aio.EOF:
            raise self._failed("closed the Execute stream")
        result = wire.result_from_proto(msg)
        if result.step_id != plan.step_id:
            raise WorkerError(f"worker answered step {result.step_id} to plan {plan.step_id}")
        return result

    def _failed(self, why: str) -> WorkerError:
        self._call = None
        return WorkerError(f"worker {self.address}: {why}")

    def reset_stream(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None

    async def close(self) -> None:
        self.reset_stream()
        await self.channel.close()
