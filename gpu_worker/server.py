"""The worker process: loads the model, sizes the KV pool and serves the Worker gRPC contract.

The servicer is thin: protobuf -> plan (pagedserve.wire) -> ModelRunner -> protobuf.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpu_worker import affinity, cpu_isa, cpu_team, host_memory
from gpu_worker.affinity import lower_threads, thread_ids, unbind_this_thread
from gpu_worker.attention import create_backend
from gpu_worker.checkpoint import load_config, load_model, model_name, size_on_disk
from gpu_worker.config import (
    DEFAULT_KV_CACHE_CAP,
    DEFAULT_KV_CACHE_SHARE,
    DTYPES,
    WorkerConfig,
    default_kv_cache_memory,
)
from gpu_worker.kv_cache import CacheGeometry, KVCache
from gpu_worker.model_runner import ModelRunner, PlanError
from gpu_worker.models.llama import CausalLM, pack_dtype
from gpu_worker.parallel import Followers, Shard, TPGroup
from gpu_worker.team import TeamSizer
from pagedserve import grpc_security, wire
from pagedserve.grammar import GrammarCompiler, vocab_tokenizer
from pagedserve.heap import freeze_heap
from pagedserve.log import get_logger, human_bytes
from pagedserve.ports import free_port
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


@dataclass
class Worker:
    config: WorkerConfig
    runner: ModelRunner
    info: worker_pb2.WorkerInfo
    followers: Followers | None = None  # tensor parallelism: ranks 1..N-1 (on rank 0)
    team: TeamSizer | None = None  # the adaptive team size (gpu_worker.team), where enabled

    def reset(self) -> None:
        if self.followers is not None:
            self.followers.send_reset()
        self.runner.reset()


def build_worker(cfg: WorkerConfig, rank: int = 0, tp_port: int | None = None) -> Worker:
    """Loads the model (rank `rank`'s shard under tensor parallelism, joining the group at
    127.0.0.1:`tp_port`) and sizes its KV pool."""
    tp = None
    threads = cfg.num_threads
    if cfg.tensor_parallel_size > 1:
        assert tp_port is not None
        if cfg.device.startswith("cuda"):  # rank r on visible device r
            cfg = replace(cfg, device=f"cuda:{rank}")
            torch.cuda.set_device(rank)
        shard = Shard.plan(load_config(cfg.model), rank, cfg.tensor_parallel_size)
        tp = TPGroup.join(shard, tp_port, cfg.device)
        threads = max(1, (threads or torch.get_num_threads()) // cfg.tensor_parallel_size)
    if threads:
        torch.set_num_threads(threads)
    dtype = cfg.torch_dtype
    team = torch.get_num_threads()
    # A bf16 model whose products are widened to float32 (a CPU without bf16 products).
    products = pack_dtype(dtype, torch.device(cfg.device))
    widened = dtype == torch.bfloat16 and products == torch.float32
    if tp is None and cpu_team.wanted(cfg.device, dtype, team, affinity.is_bound(), widened):
        # The projections' team: the model's thread and helpers that never stall it; torch's
        # own ops keep to the model's thread (docs/architecture.md, "The CPU team").
        helpers = cpu_team.start(affinity.other_cores(team - 1))
        if helpers:
            torch.set_num_threads(1)
        log.info("cpu_team", helpers=helpers, threads=team, tiles=cpu_team.tiles())
    elif dtype == torch.bfloat16 and (asked := cpu_team.tiles_asked()):
        # No team (threads not bound, more than MAX_THREADS, tensor parallel) or no tiles
        # (Linux refused AMX's state, a build without the intrinsics): oneDNN keeps them.
        log.warning("cpu_team_tiles_unused", asked=asked, threads=team, bound=affinity.is_bound())
    if cfg.device != "cpu" and cfg.cache_dtype != cfg.model_dtype:
        raise ValueError("a KV cache dtype other than the model's is supported on CPU only")
    isa = cpu_isa.bf16_isa() if cfg.device == "cpu" else None
    log.info(
        "dtype_chosen",
        dtype=cfg.model_dtype,
        requested=cfg.dtype,
        kv_cache_dtype=cfg.cache_dtype,
        device=cfg.device,
        cpu_bf16_isa=isa or "none",
    )
    path = Path(cfg.model).resolve()
    log.info(
        "model_loading",
        path=str(path),
        size=human_bytes(size_on_disk(path)),
        dtype=cfg.model_dtype,
        device=cfg.device,
    )
    t0 = time.perf_counter()
    model = load_model(cfg.model, dtype=dtype, device=cfg.device, tp=tp)
    log.info(
        "model_loaded",
        architecture=model.config.architecture,
        parameters=f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M",
        projections=model.projection_path(),
        seconds=round(time.perf_counter() - t0, 2),
    )
    t0 = time.perf_counter()
    if calls := model.warm_up(cfg.warmup_batch_size):
        log.info("kernels_warmed_up", calls=calls, seconds=round(time.perf_counter() - t0, 2))
    mc = model.config
    # The whole model's pool geometry sizes the pool (the same block count on every rank, so
    # block ids mean the same everywhere); each rank holds its KV heads' part of every block.
    whole = CacheGeometry(
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        block_size=cfg.block_size,
        dtype=DTYPES[cfg.cache_dtype],
    )
    geometry = whole if tp is None else replace(whole, num_kv_heads=tp.shard.num_kv_heads)
    num_heads = mc.num_attention_heads if tp is None else tp.shard.num_heads
    num_gpu_blocks = _num_device_blocks(cfg, whole, geometry, model, num_heads)
    num_cpu_blocks = whole.num_blocks_for(cfg.swap_space)
    if tp is not None:  # on CUDA each rank measured its own device
        num_gpu_blocks = tp.min(num_gpu_blocks)
    cache = KVCache(geometry, num_gpu_blocks, num_cpu_blocks, cfg.device)
    _log_pools(cache, cfg)
    backend = create_backend(cfg.attention_backend, cache, num_heads, mc.head_dim, cfg.device)
    max_model_len = mc.max_model_len
    if cfg.max_model_len is not None:
        max_model_len = min(max_model_len, cfg.max_model_len)
    info = worker_pb2.WorkerInfo(
        model=cfg.served_model_name or model_name(cfg.model),
        model_path=str(Path(cfg.model).resolve()),
        architecture=mc.architecture,
        dtype=cfg.model_dtype,
        kv_cache_dtype=cfg.cache_dtype,
        cpu_bf16_isa=isa or "",
        device=cfg.device,
        block_size=cfg.block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_model_len=max_model_len,
        eos_token_ids=list(mc.eos_token_ids),
        epoch=time.time_ns(),
        vocab_size=mc.vocab_size,
        attention_backend=backend.name,
        kv_cache_bytes=cache.nbytes * cfg.tensor_parallel_size,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    if tp is not None and not tp.samples:  # a follower: rank 0 samples and matches grammars
        return Worker(cfg, ModelRunner(model, cache, backend), info)
    # The structured-output compiler (~1 s for a 50k vocabulary) is built while the worker
    # warms up; the first constrained request waits for it if it comes sooner.
    grammar = futures.ThreadPoolExecutor(
        1, thread_name_prefix="grammar", initializer=unbind_this_thread
    ).submit(lambda: GrammarCompiler(vocab_tokenizer(cfg.model), mc.vocab_size, mc.eos_token_ids))

    def grammar_compiler() -> GrammarCompiler:
        try:
            return grammar.result()
        except (OSError, ValueError, RuntimeError) as exc:
            raise PlanError(f"structured output is unavailable on this worker: {exc}") from exc

    return Worker(
        cfg, ModelRunner(model, cache, backend, grammar_compiler), info, team=_team_sizer(cfg)
    )


def _team_sizer(cfg: WorkerConfig) -> TeamSizer | None:
    """The adaptive team size where the worker's threads are bound one to a core (one rank on
    the CPU, its thread count left to the default) and there are two or more of them."""
    whole = torch.get_num_threads()
    if cpu_team.active():  # its helpers never hold a step up: nothing to size
        return None
    if not cfg.adaptive_threads or cfg.device != "cpu" or cfg.tensor_parallel_size != 1:
        return None
    if whole < 2:
        return None
    log.info("threads_adaptive", sizes=[whole - 1, whole])
    return TeamSizer((whole - 1, whole))


def _log_pools(cache: KVCache, cfg: WorkerConfig) -> None:
    """The KV pool and the swap pool, each in blocks, tokens and bytes."""
    g = cache.geometry
    for event, where, blocks in (
        ("kv_cache_allocated", cfg.device, cache.num_gpu_blocks),
        ("swap_pool_allocated", "cpu", cache.num_cpu_blocks),
    ):
        log.info(
            event,
            device=where,
            blocks=blocks,
            tokens=blocks * g.block_size,
            size=human_bytes(blocks * g.bytes_per_block),
            block_size=g.block_size,
            dtype=cfg.cache_dtype,
        )


def _num_device_blocks(
    cfg: WorkerConfig,
    whole: CacheGeometry,
    geometry: CacheGeometry,
    model: CausalLM,
    num_heads: int,
) -> int:
    """KV blocks of the pool: what --kv-cache-memory holds of the whole model's blocks (split
    over the ranks under tensor parallelism); without it, on CPU what default_kv_cache_memory
    allows of the host memory still available, on CUDA what this device has left for its
    rank's `geometry` under --gpu-memory-utilization. Logs the size and why (kv_cache_sized)."""
    if cfg.kv_cache_memory is not None:
        log.info("kv_cache_sized", size=human_bytes(cfg.kv_cache_memory), by="--kv-cache-memory")
        blocks = whole.num_blocks_for(cfg.kv_cache_memory)
        if cfg.device != "cpu":  # this rank's part of them must fit beside the weights
            free, _ = torch.cuda.mem_get_info(cfg.device)
            if (need := blocks * geometry.bytes_per_block) > free:
                raise WorkerStartupError(
                    f"--kv-cache-memory {human_bytes(cfg.kv_cache_memory)} needs"
                    f" {human_bytes(need)} on {cfg.device}, which has {human_bytes(free)} free"
                    " after the weights"
                )
        return blocks
    if cfg.device == "cpu":
        available = host_memory.available_bytes()
        budget = default_kv_cache_memory(available)
        log.info(
            "kv_cache_sized",
            size=human_bytes(budget),
            by=(
                f"min({human_bytes(DEFAULT_KV_CACHE_CAP)}, {DEFAULT_KV_CACHE_SHARE:.0%} of the "
                "available host memory); --kv-cache-memory sets it"
                if available is not None
                else "the available host memory is unknown; --kv-cache-memory sets it"
            ),
            available=None if available is None else human_bytes(available),
        )
        return whole.num_blocks_for(budget)
    # CUDA: what the utilization budget leaves after the weights and a profiling pass of one
    # max-size prefill (activations), measured rather than guessed.
    torch.cuda.reset_peak_memory_stats(cfg.device)
    n = cfg.max_num_batched_tokens
    probe = KVCache(geometry, math.ceil(n / geometry.block_size), 0, cfg.device)
    backend = create_backend(cfg.attention_backend, probe, num_heads, geometry.head_dim, cfg.device)
    runner = ModelRunner(model, probe, backend)
    runner.profile(n)
    peak = torch.cuda.max_memory_allocated(cfg.device) - probe.nbytes
    del runner, backend, probe
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(cfg.device)
    budget = int(total * cfg.gpu_memory_utilization) - peak
    log.info(
        "kv_cache_sized",
        size=human_bytes(max(0, budget)),
        by=f"--gpu-memory-utilization {cfg.gpu_memory_utilization:g} of {human_bytes(total)}, "
        f"less {human_bytes(peak)} of weights and activations",
    )
    return geometry.num_blocks_for(budget)


class WorkerStartupError(RuntimeError):
    """The worker cannot start as configured (said in one line; nothing was served)."""


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
    followers = None
    try:
        if cfg.tensor_parallel_size > 1:
            # A split that cannot work is said before any rank starts.
            Shard.plan(load_config(cfg.model), 0, cfg.tensor_parallel_size)
            port = free_port()
            followers = Followers(cfg, cfg.tensor_parallel_size, port)
            worker = build_worker(cfg, rank=0, tp_port=port)
            worker.followers = followers
            followers.watch()
        else:
            worker = build_worker(cfg)
        # The model thread and the threads it has started (its OpenMP team): the threads to
        # lower once the gRPC server's own have started at the priority they all have now.
        model_threads = thread_ids()
    except ValueError as exc:  # a checkpoint, a dtype or a pool size that cannot be served
        if followers is not None:
            followers.stop()
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
        if followers is not None:
            followers.stop()
