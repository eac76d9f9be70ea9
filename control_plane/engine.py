"""One engine loop per worker: the transport around its `EngineCore`.

The core schedules and applies results (no I/O); the loop sends its plans over gRPC, reads the
results, publishes each step's tokens to the client streams (`control_plane.streams`), records
step times (`control_plane.step_telemetry`), and watches the worker's health (failover).

Runs on the control plane's asyncio event loop. Between two awaits the scheduler is touched by
exactly one coroutine, so adding, aborting and scheduling need no locks: a Generate handler
adds a request and sets the wake-up event; an abort frees the request's blocks at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from control_plane.admission import queue_delay
from control_plane.block_manager import BlockManager
from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.engine_core import CacheEvents, EngineCore, EngineCounters
from control_plane.request import Request, RequestStatus
from control_plane.scheduler import RequestOutputDelta, Scheduler, SchedulerConfig
from control_plane.step_telemetry import StepTelemetry
from control_plane.streams import OutputChunk, RequestStream
from control_plane.streams import merge_chunks as merge_chunks  # re-exported
from control_plane.tokenizer import LoadedTokenizer
from control_plane.worker_client import Probe, WorkerClient, WorkerError, WorkerRefusal
from pagedserve.log import get_logger
from pagedserve.plan import PromptLogprobRun
from pagedserve.sampling_params import InvalidRequestError
from protos.v1 import worker_pb2

log = get_logger(__name__)

# How long requests wait for their worker to come back before they move to another worker
# (or, with none, fail with UNAVAILABLE).
WORKER_FAILOVER_S = 10.0
# Failed steps in a row (the worker answering between them) before the requests are failed.
MAX_CONSECUTIVE_FAILURES = 3
# Every worker's health service is probed this often, busy or idle. One that nothing answers
# for (the process is gone) is lost at once; one that stays connected but silent (stopped,
# hung) is left out of placement after SILENT_UNHEALTHY_S and lost after the failover timeout.
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 1.0
SILENT_UNHEALTHY_S = 3.0
# A step result is overdue (the worker answers probes but its model thread is stuck) after
# the failover timeout, or this many times what the step should take if that is longer: the
# recent slowest step, or the plans' tokens at the recent slowest time per token (a worker
# handed other workers' requests replays their tokens in steps far larger than its last).
STEP_DEADLINE_FACTOR = 10.0


class EngineLoop:
    def __init__(
        self,
        client: WorkerClient,
        info: worker_pb2.WorkerInfo,
        scheduler_config: SchedulerConfig,
        tokenizer: LoadedTokenizer,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = True,
    ) -> None:
        self.client = client
        self.enable_prefix_caching = enable_prefix_caching
        self.info = info
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self.core = EngineCore(self._new_scheduler, async_scheduling)
        self.streams: dict[str, RequestStream] = {}
        self.healthy = True
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.on_step: Callable[[], None] = lambda: None
        # Moves this loop's requests to other workers; returns False when there are none.
        self.hand_off: Callable[[EngineLoop], bool] = lambda loop: False
        self.failover_after_s = WORKER_FAILOVER_S
        self._consecutive_failures = 0
        self._watch_task: asyncio.Task[None] | None = None
        self._last_answer = time.monotonic()  # a probe answered or a step result arrived
        self._waiting_since = time.monotonic()  # the oldest plan in flight has waited since
        self._recovering = False  # the worker was lost; the run loop waits for it to answer
        self._silent = False  # out of placement for silence alone, not lost yet
        self._lost: tuple[str, bool] | None = None  # (why, hand off at once), for the run loop
        self.telemetry = StepTelemetry(client.address)

    def _new_scheduler(self) -> Scheduler:
        bm = BlockManager(
            self.info.num_gpu_blocks,
            self.info.num_cpu_blocks,
            self.info.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        return Scheduler(self.scheduler_config, bm)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def counters(self) -> EngineCounters:
        return self.core.counters

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def epoch(self) -> int:
        return self.info.epoch

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request: Request,
        final_only: bool = False,
        sink: Callable[[OutputChunk | BaseException], None] | None = None,
        batch_id: str = "",
    ) -> RequestStream:
        n = request.sampling.n
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer.tokenizer,
                request.prompt_token_ids,
                request.sampling.stop,
                skip_special_tokens=request.sampling.skip_special_tokens,
                defer=final_only and not request.sampling.stop,
            )
            for _ in range(n)
        ]
        stream = RequestStream(request, detoks, [0] * n, final_only, sink=sink, batch_id=batch_id)
        self.scheduler.add_request(request)  # may refuse it: then no stream is left behind
        self.streams[request.req_id] = stream
        self._wakeup.set()
        return stream

    def abort(self, req_id: str) -> bool:
        """Finishes a request now; its blocks go back to the pool before this returns."""
        stream = self.streams.pop(req_id, None)
        if stream is None:
            return False
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.counters.num_requests_aborted += 1
        if not stream.finished:
            stream.end_aborted()
        self._wakeup.set()
        return True

    @property
    def load(self) -> int:
        """Tokens queued or running: the placement weight of this worker."""
        return sum(
            s.request.num_prompt_tokens + sum(s.num_output_tokens) for s in self.streams.values()
        )

    # -- prefix-cache events, for the cluster's prefix index ------------------------------------

    def drain_cache_events(self) -> CacheEvents:
        return self.core.drain_cache_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.core.cached_block_hashes()

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"engine-{self.client.address}")
        self._task.add_done_callback(self._run_ended)
        self._watch_task = asyncio.create_task(self.watch(), name=f"watch-{self.client.address}")

    async def stop(self) -> None:
        for task in (self._watch_task, self._task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self.client.close()

    def _run_ended(self, task: asyncio.Task[None]) -> None:
        """The run loop never ends but by stop(); should a bug end it, its requests fail with
        an error rather than hang, and the worker leaves placement."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("engine_loop_died", worker=self.client.address, error=repr(exc))
        self.healthy = False
        self._recovering = True
        assert exc is not None
        self._fail_all(exc)

    async def watch(self) -> None:
        """Probes the worker every PROBE_INTERVAL_S, whether or not it has work: a worker that
        died idle is noticed within a probe, not at the next request, and one that hangs in a
        step is noticed although its stream never breaks."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            probe = await self.client.probe(PROBE_TIMEOUT_S)
            now = time.monotonic()
            waited = now - self._waiting_since
            expected_s = self.telemetry.expected_step_s(self.core.in_flight)
            deadline = max(self.failover_after_s, STEP_DEADLINE_FACTOR * expected_s)
            if self.core.in_flight and not self._recovering and waited >= deadline:
                self._lose(f"no step result for {waited:.1f} s", hand_off_now=True)
                continue
            if probe is Probe.ANSWERED:
                self._last_answer = now
                if self._silent:
                    self._silent = False
                    self.healthy = True
                    log.info("worker_answering", worker=self.client.address)
                continue
            if self._recovering:  # the run loop is waiting for it to come back
                continue
            silent_s = now - self._last_answer
            if probe is Probe.DOWN:
                self._lose("does not answer (the process is gone)", hand_off_now=False)
            elif silent_s >= self.failover_after_s:
                self._lose(f"silent for {silent_s:.1f} s", hand_off_now=True)
            elif silent_s >= SILENT_UNHEALTHY_S and not self._silent:
                self._silent = True
                self.healthy = False
                log.warning("worker_silent", worker=self.client.address, silent_s=silent_s)

    def _drop_in_flight(self) -> None:
        self.core.drop_in_flight()
        self.telemetry.dropped()

    def queue_delay_s(self, prompt_tokens: int, seats: int) -> float:
        """Seconds a request of this many prompt tokens added now would wait for its first
        token because of the others (`control_plane.admission.queue_delay`)."""
        in_flight = self.core.in_flight
        return queue_delay(
            self.telemetry.step_cost,
            self.scheduler.config,
            self.scheduler.backlog(),
            (p.total_num_scheduled_tokens for p in in_flight),
            self.telemetry.elapsed_s(in_flight[0] if in_flight else None),
            prompt_tokens,
            seats,
            -(-prompt_tokens // self.info.block_size),
        )

    def _lose(self, why: str, hand_off_now: bool) -> None:
        """Gives the worker up: the run loop moves its requests (after the failover wait for a
        worker that may restart, at once for one that was silent that long already), and the
        step it waits for is abandoned, so a late result is never applied."""
        self.healthy = False
        self._recovering = True
        self._lost = (why, hand_off_now)
        self.client.interrupt(why)
        self._wakeup.set()

    async def run(self) -> None:
        while True:
            if (
                self._lost is None
                and not self.core.in_flight
                and not self.scheduler.has_unfinished_requests()
                and not self.scheduler.has_pending_finished()
            ):
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._lost is not None:
                why, hand_off_now = self._lost
                self._lost = None
                self._drop_in_flight()
                await self._on_worker_lost(
                    WorkerError(f"worker {self.client.address}: {why}"), hand_off_now
                )
                continue
            try:
                await self.step()
                self._consecutive_failures = 0
            except WorkerError as exc:
                self._drop_in_flight()
                if self._lost is not None:  # the watcher gave the worker up during the step
                    continue
                await self._on_worker_error(exc)
            except Exception as exc:  # a bug must fail its requests, never stop this loop
                log.exception("engine_step_failed", worker=self.client.address)
                self._drop_in_flight()
                self.client.reset_stream()
                self._fail_all(exc)
            # Let Generate handlers and aborts in between steps.
            await asyncio.sleep(0)

    async def _on_worker_error(self, exc: WorkerError) -> None:
        log.error("worker_failed", worker=self.client.address, error=str(exc))
        self.client.reset_stream()
        self._consecutive_failures += 1
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            # The same work keeps failing on a live worker: replaying it would spin for ever.
            self._fail_all(exc)
            self._consecutive_failures = 0
            await asyncio.sleep(1.0)
            return
        await self._on_worker_lost(exc, hand_off_now=False)

    async def _on_worker_lost(self, exc: WorkerError, hand_off_now: bool) -> None:
        """Requeues every request from its prompt and streamed tokens; waits up to the failover
        timeout for the worker to answer again (unless it was silent that long already), then
        hands the requests to another worker, or fails them if there is none."""
        if hand_off_now:
            log.error("worker_lost", worker=self.client.address, error=str(exc))
        self.client.clear_interrupt()  # what was in flight is dropped; new streams may start
        self._recovering = True
        self.healthy = False
        self._restart_scheduler()
        if hand_off_now or not await self._reconnect(self.failover_after_s):
            if not self.hand_off(self):
                self._fail_all(exc)
            await self._reconnect(None)

    async def step(self) -> None:
        """One iteration: apply the oldest step in flight and publish its tokens.

        With async scheduling the next plan is sent before the oldest result is read, so the
        worker finds step n+1 waiting when it finishes step n, and the control plane applies
        and publishes step n while the worker computes n+1 (see `Scheduler`). Without it, each
        plan is made after the previous result.
        """
        await self._send_plans()
        if not self.core.in_flight:
            self._wakeup.clear()
            await self._wakeup.wait()
            return
        plan = self.core.oldest
        result = await self.client.receive(plan)
        self._last_answer = self._waiting_since = time.monotonic()
        self.telemetry.received(plan, result)
        if result.prompt_logprobs:
            self._collect_prompt_logprobs(result.prompt_logprobs)
        for req_id, why in result.failed.items():  # before update, which then skips them
            self._fail_request(req_id, InvalidRequestError(f"structured output failed: {why}"))
        for req_id, why in result.refused.items():
            log.error("request_refused_by_worker", request_id=req_id, reason=why)
            self._fail_request(req_id, WorkerRefusal(f"the worker could not run it: {why}"))
        self._publish(self.core.apply(result))
        self.on_step()

    def trace_steps(self, path: str) -> None:
        """Appends one JSON line per step to `path` (`StepTelemetry.trace_to`)."""
        self.telemetry.trace_to(path)

    async def _send_plans(self) -> None:
        """Sends plans until the core's async depth is reached or there is nothing to send."""
        while (plan := self.core.next_plan()) is not None:
            tracing = self.telemetry.tracing
            self.telemetry.sent(plan, self.scheduler.plan_shape(plan) if tracing else None)
            if len(self.core.in_flight) == 1:
                self._waiting_since = time.monotonic()
            await self.client.send(plan)

    def _collect_prompt_logprobs(self, runs: dict[str, PromptLogprobRun]) -> None:
        """Appends each run to its client request's prompt logprobs. A prompt computed again
        (after a preemption, or on another worker) repeats positions already held: only what
        extends them counts."""
        for req_id, run in runs.items():
            req = self.scheduler.get_request(req_id)
            stream = self.streams.get(req.parent_id or req_id) if req is not None else None
            if stream is None:
                continue
            held = stream.prompt_logprobs
            skip = len(held) - (run.start - 1)
            if 0 <= skip < len(run.logprobs):
                held.extend(run.logprobs[skip:])

    def _publish(self, deltas: list[RequestOutputDelta]) -> None:
        now = time.monotonic()
        chunks: list[tuple[str, RequestStream, OutputChunk]] = []
        for d in deltas:
            client_id = d.parent_id or d.req_id
            stream = self.streams.get(client_id)
            if stream is None or stream.finished:
                continue
            self.counters.num_generated_tokens += len(d.new_token_ids)
            chunk = stream.chunk_for(d, now)
            if isinstance(chunk.stop_reason, str) and not d.finished:
                # A stop string ends this completion only; its siblings go on.
                self.scheduler.finish_requests([d.req_id], RequestStatus.FINISHED_STOPPED)
            chunks.append((client_id, stream, chunk))
        # A client's call ends with its last chunk of this step once none of its completions
        # is live: decided after every delta, since a stop string can end a completion after
        # a sibling's delta of the same step was built.
        last_of = {client_id: i for i, (client_id, _, _) in enumerate(chunks)}
        for i, (client_id, stream, chunk) in enumerate(chunks):
            if last_of[client_id] == i and not self.scheduler.live_requests(client_id):
                chunk.last = True
                stream.finished = True
                self.streams.pop(client_id, None)
                self.counters.num_requests_finished += 1
            stream.emit(chunk)

    async def _reconnect(self, timeout_s: float | None) -> bool:
        """Waits (up to timeout_s; None = for ever) for the worker to answer again. A restarted
        worker (new epoch, maybe another pool size) gets a scheduler sized to it. Returns False
        on timeout."""
        self.healthy = False
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                info = await self.client.describe(timeout=2.0)
                break
            except grpc.aio.AioRpcError:
                if deadline is not None and time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.2)
        if info.epoch != self.info.epoch:
            log.info("worker_restarted", worker=self.client.address, epoch=info.epoch)
            self.info = info
            self._restart_scheduler()
        else:
            log.info("worker_answering", worker=self.client.address)
        self._last_answer = time.monotonic()
        self._silent = False
        self._recovering = False
        self.healthy = True
        return True

    def _restart_scheduler(self) -> None:
        """Starts over with an empty block manager, and requeues every unfinished request as
        its prompt plus the tokens already streamed: clients see neither an error nor a
        repeated token, and generation goes on where it stopped."""
        survivors = [r for client_id in list(self.streams) for r in self.live_copies(client_id)]
        # The new block manager's cache is empty: restate it (as nothing) to the index.
        self.core.reset()
        for r in survivors:
            self._requeue(r)
        self.on_step()

    def live_copies(self, client_id: str) -> list[Request]:
        """Fresh WAITING copies of a client request's unfinished sequences (the request, or
        its forked children), carrying the tokens already streamed; a beam search's beams in
        a copy of its group (scores and finished sequences so far)."""
        live = self.scheduler.live_requests(client_id)
        if live and live[0].beam is not None:
            return live[0].beam.copy_waiting()
        return [
            Request(
                r.req_id,
                list(r.prompt_token_ids),
                r.sampling,
                r.arrival_time,
                output_token_ids=list(r.output_token_ids),
                cache_salt=r.cache_salt,
                parent_id=r.parent_id,
                index=r.index,
            )
            for r in self.scheduler.live_requests(client_id)
        ]

    def adopt(self, stream: RequestStream, requests: list[Request]) -> None:
        """Takes over a client request from another worker's loop."""
        self.streams[stream.request.req_id] = stream
        for r in requests:
            self._requeue(r)
        self._wakeup.set()

    def _requeue(self, r: Request) -> None:
        try:
            self.scheduler.add_request(r)
        except (InvalidRequestError, ValueError) as exc:  # this pool is too small for it
            self._fail_client(r.parent_id or r.req_id, exc)

    def _fail_request(self, req_id: str, exc: BaseException) -> None:
        """Ends the client request that `req_id` (itself, or one of its n sequences or beams)
        belongs to with `exc`; nothing where it has finished already."""
        req = self.scheduler.get_request(req_id)
        if req is not None:
            self._fail_client(req.parent_id or req.req_id, exc)

    def _fail_client(self, client_id: str, exc: BaseException) -> None:
        # Siblings would generate for nobody.
        self.scheduler.finish_requests([client_id], RequestStatus.FINISHED_ABORTED)
        stream = self.streams.pop(client_id, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self.streams.values():
            stream.finished = True
            stream.put(exc)
        self.streams.clear()
        self.core.reset(restate_cache=False)
