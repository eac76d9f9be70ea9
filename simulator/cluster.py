"""The control plane's own scheduling code on a virtual clock.

Each simulated worker holds a real `Scheduler` over a real `BlockManager`; placement is the
real `Router` over a `MemoryPrefixIndex` (KV-aware), or least-loaded or round-robin. Workers
are replaced by a cost model: a plan's step takes `CostModel.step_time` of virtual time, and
its result is synthetic (for every row due to sample, the next id of a sequence seeded by the
request id; EOS once the request has produced the output length its workload gave it).

Each worker is driven by the control plane's own `EngineCore`, as `EngineLoop` drives it: with
async scheduling, while the worker runs plan k, plan k+1 is already made and queued, and when
k's result arrives it is applied before plan k+2 is made. A worker with nothing in flight
starts as soon as work arrives. There are no threads and no sleeping: events (arrivals, step
ends) are popped from one heap in time order.

What it records per request: arrival, first scheduled, first token, finish, output tokens and
preemptions; per worker: steps, batch sizes, preemptions, KV use over time, prefix-cache
hits; and the control plane's real CPU time per step (schedule + update + routing), which
bounds how many workers one control-plane process can drive.
"""

from __future__ import annotations

import gc
import heapq
import time
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from control_plane.block_manager import BlockManager, PrefixHit
from control_plane.engine_core import CacheEvents, EngineCore
from control_plane.prefix_index import MemoryPrefixIndex, WorkerRef
from control_plane.request import Request
from control_plane.router import FLUSH_INTERVAL_S, Router
from control_plane.scheduler import Scheduler, SchedulerConfig
from pagedserve.plan import SampledToken, StepResult
from pagedserve.sampling_params import InvalidRequestError, SamplingParams
from simulator.config import SimConfig
from simulator.cost import CostModel
from simulator.workload import SimRequest, Workload

EOS = 2
FIRST_ID = EOS + 1
NUM_IDS = 1024  # synthetic output ids cycle through FIRST_ID .. FIRST_ID + NUM_IDS - 1

T = TypeVar("T")


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine that never suspends (the router over an in-memory index) to its end,
    without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise RuntimeError("the coroutine suspended; the simulator has no event loop")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class ReservingBlockManager(BlockManager):
    """Contiguous reservation, the Orca baselines of the PagedAttention paper: a request's
    first allocation takes room for `reserve(req_id)` tokens at once, held until it ends (no
    sharing, so prefix caching is off). Blocks stand in for a contiguous range: the reserved
    room is what counts, not where it lies."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        reserve: Callable[[str], int],
    ) -> None:
        super().__init__(num_gpu_blocks, num_cpu_blocks, block_size, enable_prefix_caching=False)
        self._reserve = reserve

    def num_blocks_to_allocate(self, req_id: str, num_tokens_total: int) -> int:
        table = self._gpu_tables.get(req_id) or self._cpu_tables.get(req_id)
        if not table:
            num_tokens_total = max(num_tokens_total, self._reserve(req_id))
        return max(0, self.num_blocks_for(num_tokens_total) - len(table or ()))

    def allocate_slots(
        self, req_id: str, num_tokens_total: int, prefix: PrefixHit | None = None
    ) -> list[int] | None:
        if not (self._gpu_tables.get(req_id) or self._cpu_tables.get(req_id)):
            num_tokens_total = max(num_tokens_total, self._reserve(req_id))
        return super().allocate_slots(req_id, num_tokens_total, prefix)


class CountingPrefixIndex(MemoryPrefixIndex):
    """The in-memory index, counting what a Redis index would be asked: operations (each a
    round trip), the hashes they carry, and the entries (block, worker) held at most."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0
        self.lookup_hashes = 0
        self.updates = 0
        self.update_hashes = 0
        self.entries = 0
        self.peak_entries = 0
        self.peak_keys = 0

    async def lookup(
        self, block_hashes: Sequence[bytes], workers: Sequence[WorkerRef]
    ) -> dict[str, int]:
        self.lookups += 1
        self.lookup_hashes += len(block_hashes)
        return await super().lookup(block_hashes, workers)

    async def update(
        self, worker: WorkerRef, stored: Sequence[bytes], removed: Sequence[bytes]
    ) -> None:
        self.updates += 1
        self.update_hashes += len(stored) + len(removed)
        for h in removed:
            if worker.worker_id in self._blocks.get(h, {}):
                self.entries -= 1
        for h in stored:
            if worker.worker_id not in self._blocks.get(h, {}):
                self.entries += 1
        self.peak_entries = max(self.peak_entries, self.entries)
        await super().update(worker, stored, removed)
        self.peak_keys = max(self.peak_keys, len(self._blocks))


@dataclass
class RequestRecord:
    req: SimRequest
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    worker: int = 0
    rejected: bool = False  # could never fit the worker's pool (the control plane's 400)


@dataclass
class WorkerStats:
    steps: int = 0
    busy_s: float = 0.0
    row_seconds: float = 0.0  # sum of rows x step time: the time-weighted batch size
    tokens: int = 0
    rows: int = 0
    empty_steps: int = 0  # plans without tokens (dropped requests only)
    kv_series: list[tuple[float, float, float]] = field(default_factory=list)


@dataclass
class SimStep:
    """A plan in flight on a simulated worker: its length and the rows due to sample."""

    duration: float
    sampling: frozenset[str]


class SimWorker:
    """A simulated worker as the router sees it (`control_plane.router.Placeable`): the
    engine core that drives it, a load figure, and the plans in flight's simulated steps."""

    def __init__(self, index: int, core: EngineCore) -> None:
        self.index = index
        self.address = f"sim-worker-{index}"
        self.epoch = 1
        self.healthy = True
        self.on_step: Callable[[], None] = lambda: None
        self.core = core
        self.load = 0  # tokens queued or running (EngineLoop.load)
        self.steps: deque[SimStep] = deque()  # one per plan in the core's in_flight
        self.stats = WorkerStats()
        self.next_kv_sample = 0.0

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def drain_cache_events(self) -> CacheEvents:
        return self.core.drain_cache_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.core.cached_block_hashes()


class Simulation:
    def __init__(self, config: SimConfig, cost: CostModel, workload: Workload) -> None:
        self.config = config
        self.cost = cost
        self.workload = workload
        c = config
        self.max_model_len = c.max_model_len or cost.model.max_model_len
        self.num_gpu_blocks = c.num_gpu_blocks or cost.num_gpu_blocks(
            c.gpu_memory_utilization, c.max_num_batched_tokens, c.max_num_seqs
        )
        self.num_cpu_blocks = (
            cost.num_cpu_blocks(c.swap_space_bytes) if c.preemption == "swap" else 0
        )
        self.records: dict[str, RequestRecord] = {}
        self._targets: dict[str, int] = {}  # req_id -> output length (EOS after it)
        self._seeds: dict[str, int] = {}  # req_id -> where its synthetic ids start
        self._prompt_lens: dict[str, int] = {}
        self.workers = [
            SimWorker(i, EngineCore(self._scheduler, c.async_scheduling))
            for i in range(c.num_workers)
        ]
        self.index = CountingPrefixIndex()
        self.router = Router(self.workers, self.index, c.block_size)
        self._rr = 0
        self._index_in_use = c.routing == "kv-aware" and c.num_workers > 1
        self._next_sync = 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.cp_cpu_s = 0.0
        self.cp_steps = 0
        self._tokens = [SampledToken(token_id=FIRST_ID + i) for i in range(NUM_IDS)]
        self._eos = SampledToken(token_id=EOS)

    # -- construction ----------------------------------------------------------------------------

    def _reservation(self, req_id: str) -> int:
        """Tokens an Orca baseline reserves for a request: the maximum length, the prompt and
        the next power of two of the output, or the prompt and the true output; rounded up to
        a power of two, as the buddy allocator the paper assumes for Orca hands out memory."""
        prompt, out = self._prompt_lens[req_id], self._targets[req_id]
        a = self.config.allocation
        if a == "orca-max":
            want = self.max_model_len
        elif a == "orca-pow2":
            want = prompt + next_pow2(out)
        else:
            want = prompt + out
        return min(self.max_model_len, next_pow2(want))

    def _scheduler(self) -> Scheduler:
        c = self.config
        bm: BlockManager
        if c.allocation == "paged":
            bm = BlockManager(
                self.num_gpu_blocks,
                self.num_cpu_blocks,
                c.block_size,
                enable_prefix_caching=c.enable_prefix_caching,
            )
        else:
            bm = ReservingBlockManager(
                self.num_gpu_blocks, self.num_cpu_blocks, c.block_size, self._reservation
            )
        cfg = SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=c.preemption,
            eos_token_ids=(EOS,),
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            max_prefill_tokens_with_decodes=c.max_prefill_tokens_with_decodes,
        )
        return Scheduler(cfg, bm)

    # -- events ----------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def run(self, requests: Iterable[SimRequest] | None = None) -> SimResult:
        wall = time.perf_counter()
        for r in self.workload.requests() if requests is None else requests:
            self._push(r.arrival_s, 0, r)
        events = self._events
        # The loop allocates millions of short-lived acyclic objects (plans, deltas, results);
        # generation-0 collections over the long-lived scheduler state cost more than they free.
        threshold = gc.get_threshold()
        gc.set_threshold(200_000, 50, 100)
        try:
            self._loop(events)
        finally:
            gc.set_threshold(*threshold)
        for w in self.workers:
            w.scheduler.check_integrity()
        return SimResult(self, time.perf_counter() - wall)

    def _loop(self, events: list[tuple[float, int, int, Any]]) -> None:
        while events:
            t, _, kind, obj = heapq.heappop(events)
            self.now = t
            if kind == 0:
                self._arrive(obj)
            else:
                self._step_done(obj)

    # -- requests --------------------------------------------------------------------------------

    def _arrive(self, r: SimRequest) -> None:
        t0 = time.perf_counter()
        worker = self._place(r.prompt_ids)
        prompt_len = len(r.prompt_ids)
        self._targets[r.req_id] = r.output_len
        self._seeds[r.req_id] = zlib.crc32(r.req_id.encode())
        self._prompt_lens[r.req_id] = prompt_len
        self.records[r.req_id] = rec = RequestRecord(r, self.now, worker=worker.index)
        try:
            if r.ignore_eos:
                sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            else:
                sp = SamplingParams(max_tokens=self.max_model_len - prompt_len, temperature=0.0)
            worker.scheduler.add_request(Request(r.req_id, r.prompt_ids, sp, arrival_time=self.now))
        except InvalidRequestError:  # the real control plane answers 400
            rec.rejected = True
            del self._targets[r.req_id], self._seeds[r.req_id], self._prompt_lens[r.req_id]
            return
        worker.load += prompt_len
        self.cp_cpu_s += time.perf_counter() - t0
        if not worker.core.in_flight:
            self._send(worker)

    def _place(self, prompt_ids: list[int]) -> SimWorker:
        routing = self.config.routing
        if len(self.workers) == 1:
            return self.workers[0]
        if routing == "kv-aware":
            return run_coroutine(self.router.place(prompt_ids, None))
        if routing == "least-loaded":
            return min(self.workers, key=lambda w: w.load)
        self._rr = (self._rr + 1) % len(self.workers)
        return self.workers[self._rr]

    # -- steps -----------------------------------------------------------------------------------

    def _send(self, worker: SimWorker) -> None:
        """Sends the core's next plans: one running and, with async scheduling, the next one
        made."""
        core, steps = worker.core, worker.steps
        while True:
            t0 = time.perf_counter()
            plan = core.next_plan()
            if plan is None:
                self.cp_cpu_s += time.perf_counter() - t0
                return
            sched = core.scheduler
            sampling = sched.sampling_rows(plan) if plan.num_scheduled_tokens else frozenset()
            duration = self.cost.step_time(sched.plan_shape(plan))
            self.cp_cpu_s += time.perf_counter() - t0
            steps.append(SimStep(duration, sampling))
            if len(steps) == 1:
                self._start(worker)

    def _start(self, worker: SimWorker) -> None:
        plan, duration = worker.core.oldest, worker.steps[0].duration
        for new in plan.new_requests:
            rec = self.records.get(new.req_id)
            if rec is not None and rec.scheduled is None:
                rec.scheduled = self.now
        s = worker.stats
        s.steps += 1
        s.busy_s += duration
        s.row_seconds += len(plan.num_scheduled_tokens) * duration
        s.tokens += plan.total_num_scheduled_tokens
        s.rows += len(plan.num_scheduled_tokens)
        s.empty_steps += not plan.num_scheduled_tokens
        self._push(self.now + duration, 1, worker)

    def _step_done(self, worker: SimWorker) -> None:
        t0 = time.perf_counter()
        core = worker.core
        plan, sampling = core.oldest, worker.steps.popleft().sampling
        sampled: dict[str, SampledToken] = {}
        if sampling:
            targets, seeds, tokens, eos = self._targets, self._seeds, self._tokens, self._eos
            get_request = core.scheduler.get_request
            for req_id in sampling:
                req = get_request(req_id)
                if req is None:  # ended from outside while the step ran
                    continue
                k = len(req.output_token_ids)
                sampled[req_id] = (
                    eos if k + 1 >= targets[req_id] else tokens[(seeds[req_id] + k) % NUM_IDS]
                )
        deltas = core.apply(StepResult(plan.step_id, sampled))
        if plan.num_scheduled_tokens:
            self.cp_steps += 1
            now = self.now
            for d in deltas:
                rec = self.records[d.req_id]
                if rec.first_token is None:
                    rec.first_token = now
                rec.output_tokens += 1
                worker.load += 1
                if d.finished:
                    self._finished(worker, rec)
            if self._index_in_use and now >= self._next_sync:
                # The router's flush task: every 5 ms at most.
                run_coroutine(self.router.sync())
                self._next_sync = now + FLUSH_INTERVAL_S
        self.cp_cpu_s += time.perf_counter() - t0
        if self.now >= worker.next_kv_sample:
            self._sample_kv(worker)
        if worker.steps:
            self._start(worker)
        self._send(worker)

    def _finished(self, worker: SimWorker, rec: RequestRecord) -> None:
        rec.finish = self.now
        req_id = rec.req.req_id
        worker.load -= len(rec.req.prompt_ids) + rec.output_tokens
        del self._targets[req_id]
        del self._prompt_lens[req_id]
        seed = self._seeds.pop(req_id)
        if rec.req.session is not None:
            # The ids the model produced: the seeded sequence, then EOS.
            n = rec.output_tokens - 1
            out = [FIRST_ID + (seed + k) % NUM_IDS for k in range(n)] + [EOS]
            nxt = self.workload.next_turn(rec.req, out, self.now)
            if nxt is not None:
                self._push(nxt.arrival_s, 0, nxt)

    def _sample_kv(self, worker: SimWorker) -> None:
        bm = worker.scheduler.block_manager
        used = bm.num_gpu_blocks - bm.num_free_gpu_blocks
        held_tokens = sum(r.num_computed_tokens for r in worker.scheduler.running)
        slots = bm.num_gpu_blocks * bm.block_size
        worker.stats.kv_series.append(
            (self.now, used / bm.num_gpu_blocks, min(1.0, held_tokens / slots))
        )
        worker.next_kv_sample = self.now + self.config.kv_sample_interval_s


class SimResult:
    """The simulation's records, kept for `simulator.report`."""

    def __init__(self, sim: Simulation, wall_s: float) -> None:
        self.sim = sim
        self.wall_s = wall_s
        self.records = list(sim.records.values())
        self.workers = sim.workers
        self.end_s = sim.now
