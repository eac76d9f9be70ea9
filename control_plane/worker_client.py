"""The control plane's side of one worker: Describe, then one Execute stream for its life."""

from __future__ import annotations

import asyncio
import enum

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import wire
from pagedserve.grpc_security import INSECURE, GrpcSecurity, aio_channel
from pagedserve.plan import StepPlan, StepResult
from pagedserve.sampling_params import StructuredOutput
from protos.v1 import worker_pb2, worker_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A worker that comes back (restarted, or late at startup) is reconnected within 2 s:
    # gRPC's default back-off grows to 120 s between attempts.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class Probe(enum.Enum):
    ANSWERED = "answered"
    DOWN = "down"  # nothing listens, or the connection broke
    SILENT = "silent"  # connected, but no answer in time (stopped, or hung)


class WorkerError(RuntimeError):
    """The worker stream failed; every request on it must be failed or recomputed."""


class WorkerRefusal(RuntimeError):
    """The worker could not run a request's part of a plan (it contradicted the worker's
    state): that request fails, and the stream goes on."""


class WorkerClient:
    def __init__(self, address: str, *, security: GrpcSecurity = INSECURE) -> None:
        self.address = address
        self.channel = aio_channel(address, security, CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        # Why the stream was given up (interrupt), until the engine has dealt with it: every
        # send and receive meanwhile fails at once.
        self._given_up: str | None = None
        # Resolved by interrupt(): what a receive() waits on beside the read (one future per
        # stream's life, not one per step).
        self._given_up_waiter: asyncio.Future[None] | None = None

    async def probe(self, timeout: float) -> Probe:
        """One health check, never waiting for a connection. A worker that answers anything
        but SERVING (it is shutting down) counts as down."""
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            silent = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return Probe.SILENT if silent else Probe.DOWN
        serving = resp.status == health_pb2.HealthCheckResponse.SERVING
        return Probe.ANSWERED if serving else Probe.DOWN

    def interrupt(self, why: str) -> None:
        """Gives up the Execute stream: a send or receive waiting on it raises WorkerError(why)
        now, as does every one after until clear_interrupt(), and whatever the worker still
        sends on it is never read."""
        self._given_up = why
        if self._given_up_waiter is not None and not self._given_up_waiter.done():
            self._given_up_waiter.set_result(None)
        self.reset_stream()

    def clear_interrupt(self) -> None:
        self._given_up = None
        self._given_up_waiter = None

    async def describe(self, timeout: float) -> worker_pb2.WorkerInfo:
        return await self.stub.Describe(
            worker_pb2.DescribeRequest(), timeout=timeout, wait_for_ready=True
        )

    async def prepare_grammar(self, constraint: StructuredOutput, timeout: float) -> None:
        """Has the worker compile a constraint before a request carrying it is scheduled.
        Raises grpc.aio.AioRpcError (INVALID_ARGUMENT: it does not compile; DEADLINE_EXCEEDED:
        not within `timeout`)."""
        request = worker_pb2.PrepareGrammarRequest(constraint=wire.structured_to_proto(constraint))
        await self.stub.PrepareGrammar(request, timeout=timeout)

    async def send(self, plan: StepPlan) -> None:
        """Writes a plan to the Execute stream; its result is read with receive()."""
        if self._given_up is not None:
            raise self._failed(self._given_up)
        try:
            if self._call is None:
                self._call = self.stub.Execute()
            await self._call.write(wire.plan_to_proto(plan))
        except grpc.aio.AioRpcError as exc:
            raise self._failed(f"{exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError as exc:  # the stream ended while we were idle
            raise self._failed("the Execute stream has ended") from exc
        except asyncio.CancelledError as exc:
            # A write blocked by flow control raises this when interrupt() cancels the call;
            # the task's own cancellation (stopping) goes on as it is.
            task = asyncio.current_task()
            if self._given_up is None or (task is not None and task.cancelling()):
                raise
            raise self._failed(self._given_up) from exc

    async def receive(self, plan: StepPlan) -> StepResult:
        """Reads the result of the plan sent last."""
        if self._given_up is not None:
            raise self._failed(self._given_up)
        if self._call is None:
            raise WorkerError(f"worker {self.address}: no plan is in flight")
        if self._given_up_waiter is None:
            self._given_up_waiter = asyncio.get_running_loop().create_future()
        read = asyncio.ensure_future(self._call.read())
        await asyncio.wait((read, self._given_up_waiter), return_when=asyncio.FIRST_COMPLETED)
        if self._given_up is not None:  # even a result that came meanwhile is dropped
            read.cancel()
            raise self._failed(self._given_up)
        try:
            msg = read.result()
        except grpc.aio.AioRpcError as exc:
            raise self._failed(f"{exc.code().name}: {exc.details()}") from exc
        except (asyncio.InvalidStateError, asyncio.CancelledError) as exc:
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
