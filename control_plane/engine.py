"""One engine loop per worker: schedule -> execute -> update, and the streams back to clients.

Runs on the control plane's asyncio event loop. Between two awaits the scheduler is touched by
exactly one coroutine, so adding, aborting and scheduling need no locks: a Generate handler
adds a request and sets the wake-up event; an abort frees the request's blocks at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from control_plane.block_manager import BlockManager
from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.request import Request, RequestStatus
from control_plane.scheduler import RequestOutputDelta, Scheduler, SchedulerConfig
from control_plane.tokenizer import LoadedTokenizer
from control_plane.worker_client import WorkerClient, WorkerError
from pagedserve.log import get_logger
from pagedserve.plan import SampledToken
from protos.v1 import worker_pb2

log = get_logger(__name__)


@dataclass
class OutputChunk:
    """What a client receives after a step: the new tokens and the text they completed."""

    token_ids: list[int]
    text: str
    logprobs: list[SampledToken]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class RequestStream:
    request: Request
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue[OutputChunk | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False
    first_token_time: float | None = None


@dataclass
class EngineCounters:
    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0


class EngineLoop:
    def __init__(
        self,
        client: WorkerClient,
        info: worker_pb2.WorkerInfo,
        scheduler_config: SchedulerConfig,
        tokenizer: LoadedTokenizer,
    ) -> None:
        self.client = client
        self.info = info
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self.scheduler = self._new_scheduler()
        self.streams: dict[str, RequestStream] = {}
        self.counters = EngineCounters()
        self.healthy = True
        self._wakeup = asyncio.Event()
        self._step_id = 0
        self._task: asyncio.Task[None] | None = None

    def _new_scheduler(self) -> Scheduler:
        bm = BlockManager(self.info.num_gpu_blocks, self.info.num_cpu_blocks, self.info.block_size)
        return Scheduler(self.scheduler_config, bm)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> RequestStream:
        detok = IncrementalDetokenizer(
            self.tokenizer.tokenizer, request.prompt_token_ids, request.sampling.stop
        )
        stream = RequestStream(request, detok)
        self.streams[request.req_id] = stream
        self.scheduler.add_request(request)
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
            stream.finished = True
            r = stream.request
            stream.queue.put_nowait(
                OutputChunk([], "", [], r.num_prompt_tokens, r.num_output_tokens, "abort")
            )
        self._wakeup.set()
        return True

    @property
    def load(self) -> int:
        """Tokens queued or running: the placement weight of this worker."""
        return sum(s.request.num_tokens for s in self.streams.values())

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"engine-{self.client.address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.client.close()

    async def run(self) -> None:
        while True:
            if (
                not self.scheduler.has_unfinished_requests()
                and not self.scheduler.has_pending_finished()
            ):
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self.step()
            except WorkerError as exc:
                self._fail_all(exc)
                await asyncio.sleep(0.5)
            # Let Generate handlers and aborts in between steps.
            await asyncio.sleep(0)

    async def step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._wakeup.clear()
            await self._wakeup.wait()
            return
        self._step_id += 1
        plan.step_id = self._step_id
        result = await self.client.step(plan)
        self.counters.num_steps += 1
        deltas = self.scheduler.update(plan, result)
        self._publish(deltas)

    def _publish(self, deltas: list[RequestOutputDelta]) -> None:
        now = time.monotonic()
        stopped: list[str] = []
        for d in deltas:
            stream = self.streams.get(d.req_id)
            if stream is None or stream.finished:
                continue
            r = stream.request
            self.counters.num_generated_tokens += len(d.new_token_ids)
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.counters.num_prompt_tokens_computed += r.num_prompt_tokens
            text = stream.detokenizer.add(d.new_token_ids, d.finished)
            finish_reason = d.finish_reason
            stop_reason: str | None = None if d.stop_reason is None else str(d.stop_reason)
            if text.stop_string is not None and not d.finished:
                finish_reason, stop_reason = "stop", text.stop_string
                stopped.append(d.req_id)
            elif text.stop_string is not None:
                finish_reason, stop_reason = "stop", text.stop_string
            chunk = OutputChunk(
                token_ids=d.new_token_ids,
                text=text.text,
                logprobs=d.logprobs,
                num_prompt_tokens=r.num_prompt_tokens,
                num_output_tokens=r.num_output_tokens,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            if finish_reason is not None:
                stream.finished = True
                self.streams.pop(d.req_id, None)
                self.counters.num_requests_finished += 1
            stream.queue.put_nowait(chunk)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

    def _fail_all(self, exc: WorkerError) -> None:
        """The worker stream broke: fail what ran on it and start over with a clean state."""
        log.error("worker_failed", worker=self.client.address, error=str(exc))
        self.client.reset_stream()
        for stream in self.streams.values():
            stream.finished = True
            stream.queue.put_nowait(exc)
        self.streams.clear()
        self.scheduler = self._new_scheduler()
