"""The worker process: loads the model, sizes the KV pool and serves the Worker gRPC contract.

The servicer is thin: protobuf -> plan (pagedserve.wire) -> ModelRunner -> protobuf.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from functools import partial
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpu_worker.affinity import lower_threads, thread_ids, unbind_this_thread
from gpu_worker.build import Worker, WorkerStartupError, start_worker
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import PlanError
from pagedserve import grpc_security, wire
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger
from pagedserve.sampling_params import InvalidRequestError
from protos.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)

T = TypeVar("T")

# A second Execute stream waits this long for the first to end before being refused.
STREAM_ACQUIRE_TIMEOUT_S = 30.0


class ModelThread:
    """Runs every torch call of the worker on one thread: the one that calls `run()`.

    OpenMP gives each thread that starts parallel work its own team. With a second team (the
    model loaded on the main thread, steps on a gRPC thread) the process has more OpenMP
    threads than cores, and libgomp then stops spinning between parallel regions: every small
    op pays a futex wake-up, ~30% of a CPU decode step. The thread that loads the model runs
    the steps too, handed over from the gRPC threads through a queue.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[futures.Future[Any], Callable[[], Any]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> futures.Future[T]:
        """Queues a call; once `run()` has returned, the future fails with WorkerStopping."""
        future: futures.Future[T] = futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(WorkerStopping("the worker is stopping"))
            else:
                self._calls.put((future, fn))
        return future

    def run(self, stopped: Callable[[], bool], poll_s: float = 0.25) -> None:
        """Runs submitted calls until `stopped()` (asked whenever none came for poll_s) or an
        interrupt; then fails every call still queued, so that no caller waits for ever."""
        try:
            while True:
                try:
                    future, fn = self._calls.get(timeout=poll_s)
                except queue.Empty:
                    if stopped():
                        return
                    continue
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # the caller re-raises it
                        future.set_exception(exc)
                    except BaseException:  # an interrupt stops the worker, not this call only
                        future.set_exception(WorkerStopping("the worker is stopping"))
                        raise
        finally:
            with self._lock:
                self._closed = True
            while True:
                try:
                    future, _ = self._calls.get_nowait()
                except queue.Empty:
                    break
                if future.set_running_or_notify_cancel():
                    future.set_exception(WorkerStopping("the worker is stopping"))


# Structured-output compilations: at most COMPILE_THREADS run at once, at most PREPARE_SLOTS
# calls wait for one (each holds a gRPC thread, of GRPC_THREADS: health checks and the Execute
# stream need theirs).
COMPILE_THREADS = 2
PREPARE_SLOTS = 16
GRPC_THREADS = 32


class WorkerStopping(RuntimeError):
    """A step submitted while (or after) the worker stops."""


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker, model: ModelThread) -> None:
        self.worker = worker
        self.model = model
        self._stream_lock = threading.Lock()
        self._prepare_slots = threading.BoundedSemaphore(PREPARE_SLOTS)
        self._compiles = futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="compile", initializer=unbind_this_thread
        )

    def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self.worker.info

    def PrepareGrammar(
        self, request: worker_pb2.PrepareGrammarRequest, context: grpc.ServicerContext
    ) -> worker_pb2.PrepareGrammarResponse:
        """Compiles off the model thread, so that it finds the grammar cached; beyond
        PREPARE_SLOTS waiting calls, RESOURCE_EXHAUSTED (the client retries)."""
        if not self._prepare_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the worker is busy compiling")
        try:
            constraint = wire.structured_from_proto(request.constraint)
            start = time.perf_counter()
            grammar = self.worker.runner.grammar()
            self._compiles.submit(grammar.compile, constraint).result(context.time_remaining())
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the constraint is still compiling")
        except (InvalidRequestError, PlanError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self._prepare_slots.release()
        return worker_pb2.PrepareGrammarResponse(compile_s=time.perf_counter() - start)

    def Execute(
        self, request_iterator: Iterator[worker_pb2.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.StepResult]:
        if not self._stream_lock.acquire(timeout=STREAM_ACQUIRE_TIMEOUT_S):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another Execute stream is open")
        steps: queue.SimpleQueue[tuple[int, futures.Future[worker_pb2.StepResult]] | None] = (
            queue.SimpleQueue()
        )
        # Plans go to the model thread as they arrive, so the step the control plane sent ahead
        # is queued there before this one's result is on its way back: no gap between steps.
        closed = _StreamClosed()
        reader = threading.Thread(
            target=self._read_plans,
            args=(request_iterator, steps, closed),
            name="plans",
            daemon=True,
        )
        try:
            self.model.submit(self.worker.reset).result()
            log.info("execute_stream_opened", peer=context.peer())
            reader.start()
            while (step := steps.get()) is not None:
                step_id, future = step
                try:
                    result = future.result()
                except (PlanError, InvalidRequestError, ValueError) as exc:
                    log.error("bad_plan", step_id=step_id, error=str(exc))
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except WorkerStopping as exc:
                    context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                yield result
            log.info("execute_stream_closed")
        finally:
            # The reader may still wait for a plan the control plane will never send: it is
            # not waited for (the call's status goes out as this returns), and it submits
            # nothing after the reset below, so the next stream sees no plan of this one.
            with closed.lock:
                closed.closed = True
                self.model.submit(self.worker.reset)  # after any step still queued
            self._stream_lock.release()

    def _read_plans(
        self,
        request_iterator: Iterator[worker_pb2.StepPlan],
        steps: queue.SimpleQueue[tuple[int, futures.Future[worker_pb2.StepResult]] | None],
        closed: _StreamClosed,
    ) -> None:
        try:
            for msg in request_iterator:
                with closed.lock:
                    if closed.closed:
                        break
                    steps.put((msg.step_id, self.model.submit(partial(_step, self.worker, msg))))
        except grpc.RpcError:
            pass  # the call was cancelled or the control plane went away
        finally:
            steps.put(None)


class _StreamClosed:
    """Set once an Execute call has ended; its reader submits no plan after that."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False


def _step(worker: Worker, msg: worker_pb2.StepPlan) -> worker_pb2.StepResult:
    """Decodes, runs and encodes one step, all on the model thread. The gRPC threads then only
    move messages: their Python would otherwise hold the GIL at the model thread's op
    boundaries, and every hand-over of the GIL costs the step time. A plan that does not decode
    fails its step with INVALID_ARGUMENT, which ends the stream; one that contradicts this
    worker's state is answered with its requests refused (`ModelRunner.refuse`), and the stream
    goes on. Under tensor parallelism the plan's bytes go to the other ranks first."""
    plan = wire.plan_from_proto(msg)
    if worker.followers is None:
        try:
            if worker.team is None:
                return wire.result_to_proto(worker.runner.execute(plan))
            with worker.team.step(len(plan.num_scheduled_tokens), plan.total_num_scheduled_tokens):
                return wire.result_to_proto(worker.runner.execute(plan))
        except PlanError as exc:
            log.error("bad_plan", step_id=plan.step_id, error=str(exc))
            return wire.result_to_proto(worker.runner.refuse(plan, str(exc)))
    worker.followers.send_plan(msg.SerializeToString())
    try:
        return wire.result_to_proto(worker.runner.execute(plan))
    except BaseException as exc:
        # The other ranks are in this plan's collectives: the group cannot get back in step,
        # so it ends, and the control plane moves its requests as for any lost worker.
        log.error("tensor_parallel_step_failed", step_id=msg.step_id, error=repr(exc))
        os._exit(1)


def serve(cfg: WorkerConfig, ready: threading.Event | None = None) -> None:
    """Loads the model and serves until the process is stopped; the calling thread runs the
    model (see ModelThread)."""
    model = ModelThread()
    try:
        worker = start_worker(cfg)
        # The model thread and the threads it has started (its OpenMP team): the threads to
        # lower once the gRPC server's own have started at the priority they all have now.
        model_threads = thread_ids()
    except ValueError as exc:  # a checkpoint, a dtype or a pool size that cannot be served
        raise WorkerStartupError(str(exc)) from exc
    log.info(
        "worker_ready",
        model=worker.info.model,
        device=cfg.device,
        dtype=worker.info.dtype,
        kv_cache_dtype=worker.info.kv_cache_dtype,
        num_gpu_blocks=worker.info.num_gpu_blocks,
        num_cpu_blocks=worker.info.num_cpu_blocks,
        block_size=cfg.block_size,
        attention_backend=worker.info.attention_backend,
        frozen_objects=freeze_heap(),
    )
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # Notice a control plane that vanished without closing its stream, and accept the
        # control plane's own keepalive pings.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    server = grpc_security.server(
        cfg.grpc_security,
        futures.ThreadPoolExecutor(max_workers=GRPC_THREADS, initializer=unbind_this_thread),
        options,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker, model), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    grpc_security.add_port(server, f"{cfg.host}:{cfg.port}", cfg.grpc_security)
    server.start()
    for name in ("", names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker_listening", address=f"{cfg.host}:{cfg.port}")
    if cfg.nice > 0:
        log.info(
            "cpu_priority_lowered", nice=cfg.nice, threads=lower_threads(model_threads, cfg.nice)
        )
    if ready is not None:
        ready.set()
    try:
        # wait_for_termination returns True when it timed out, i.e. the server still runs.
        model.run(stopped=lambda: not server.wait_for_termination(timeout=0))
    except KeyboardInterrupt:
        pass
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=5).wait()
        if worker.followers is not None:
            worker.followers.stop()
