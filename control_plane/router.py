"""Placement across workers, and keeping the prefix index in step with the block managers.

A new request costs one prefix-index lookup: for every worker, the longest run of the prompt's
blocks it holds. The request goes to the worker with the lowest estimated cost,

    cost = prompt tokens it would still have to compute + tokens already queued or running there,

so a cached prefix wins until the worker holding it is loaded by more than the prefix saves.
When the index cannot answer, placement uses load alone and serving goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from control_plane.block_hash import request_block_hashes
from control_plane.engine_core import CacheEvents
from control_plane.prefix_index import (
    PrefixIndex,
    PrefixIndexTimeout,
    PrefixIndexUnavailable,
    WorkerRef,
)
from pagedserve.log import get_logger

log = get_logger(__name__)

FLUSH_INTERVAL_S = 0.005
RECOVERY_INTERVAL_S = 0.5
# With no step to flush for this long, the index is asked whether it still holds what it was
# given: a Redis restarted in an idle moment is rebuilt before the next request needs it.
CHECK_INTERVAL_S = 2.0


class Placeable(Protocol):
    """What placement asks of a worker's engine (`EngineLoop`, or the simulator's worker).

    The router sets `on_step`; the engine calls it after each step, so that the cache events
    the step left are flushed to the index."""

    healthy: bool  # False: left out of placement while another worker is healthy
    on_step: Callable[[], None]

    @property
    def address(self) -> str: ...

    @property
    def epoch(self) -> int: ...  # the worker process's; a restarted worker has a new one

    @property
    def load(self) -> int: ...  # tokens queued or running

    def drain_cache_events(self) -> CacheEvents: ...

    def cached_block_hashes(self) -> list[bytes]: ...


W = TypeVar("W", bound=Placeable)


@dataclass
class RoutingCounters:
    num_routed: int = 0
    num_routed_with_prefix_hit: int = 0
    num_lookup_timeouts: int = 0


class Router(Generic[W]):
    def __init__(self, loops: Sequence[W], index: PrefixIndex, block_size: int) -> None:
        self.loops = list(loops)
        self.index = index
        self.block_size = block_size
        self.available = True
        self.counters = RoutingCounters()
        self._tasks: list[asyncio.Task[None]] = []
        self._wakeup = asyncio.Event()
        for loop in self.loops:
            loop.on_step = self._wakeup.set

    def ref(self, loop: W) -> WorkerRef:
        return WorkerRef(loop.address, loop.epoch)

    async def start(self) -> None:
        # A worker that restarted has a new epoch: drop what the index says about its old self.
        try:
            await self._rebuild()
        except PrefixIndexUnavailable as exc:
            self._lost(exc)
            self._wakeup.set()
        self._tasks.append(asyncio.create_task(self._flush_forever(), name="prefix-index-sync"))

    async def add(self, loop: W) -> None:
        """Takes in a worker that registered after the start: what the index says of an earlier
        process at its address carries another epoch and is fenced off already."""
        loop.on_step = self._wakeup.set
        self.loops.append(loop)
        if self.available:
            try:
                await self.index.replace_worker(self.ref(loop), [])
            except PrefixIndexUnavailable as exc:
                self._lost(exc)
                self._wakeup.set()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.index.close()

    async def place(self, prompt_ids: list[int], cache_salt: str | None) -> W:
        self.counters.num_routed += 1
        if len(self.loops) == 1:
            return self.loops[0]
        hits = await self._lookup(prompt_ids, cache_salt)
        n = len(prompt_ids)

        def cost(loop: W) -> int:
            cached = min(hits.get(loop.address, 0) * self.block_size, n - 1)
            return (n - cached) + loop.load

        # A worker that does not answer is never chosen (admission has checked that one does;
        # should all stop during the lookup, the failover path takes the request).
        best = min([loop for loop in self.loops if loop.healthy] or self.loops, key=cost)
        if hits.get(best.address, 0) > 0:
            self.counters.num_routed_with_prefix_hit += 1
        return best

    async def _lookup(self, prompt_ids: list[int], cache_salt: str | None) -> dict[str, int]:
        if not self.available:
            return {}
        # The last prompt token is always recomputed, so only blocks before it can be hits.
        hashes = request_block_hashes(prompt_ids[:-1], self.block_size, cache_salt)
        if not hashes:
            return {}
        try:
            return await self.index.lookup(hashes, [self.ref(loop) for loop in self.loops])
        except PrefixIndexTimeout:
            self.counters.num_lookup_timeouts += 1
            return {}
        except PrefixIndexUnavailable as exc:
            self._lost(exc)
            return {}

    def _lost(self, exc: Exception) -> None:
        if self.available:
            log.warning("prefix_index_unavailable", error=str(exc))
        self.available = False

    async def _flush_forever(self) -> None:
        while True:
            try:
                async with asyncio.timeout(CHECK_INTERVAL_S):
                    await self._wakeup.wait()
            except TimeoutError:
                await self._check()
                continue
            self._wakeup.clear()
            await self.sync()
            await asyncio.sleep(FLUSH_INTERVAL_S)

    async def _check(self) -> None:
        if not self.available:
            self._wakeup.set()
            return
        try:
            await self.index.check()
        except PrefixIndexUnavailable as exc:
            self._lost(exc)
            self._wakeup.set()

    async def sync(self) -> None:
        """Brings the index up to date with the block managers' events (or, after an outage,
        rebuilds it once it answers)."""
        if self.available:
            await self._flush()
        else:
            await self._recover()

    async def _flush(self) -> None:
        for loop in self.loops:
            ev = loop.drain_cache_events()
            try:
                if ev.replace:
                    await self.index.replace_worker(self.ref(loop), ev.stored)
                elif ev.stored or ev.removed:
                    await self.index.update(self.ref(loop), ev.stored, ev.removed)
            except PrefixIndexUnavailable as exc:
                self._lost(exc)
                self._wakeup.set()  # recover now, not at the next step
                return

    async def _recover(self) -> None:
        """Retries until the index answers, then rebuilds it from the block managers."""
        while True:
            try:
                await self.index.reconnect()
                await self._rebuild()
            except PrefixIndexUnavailable:
                await asyncio.sleep(RECOVERY_INTERVAL_S)
                continue
            log.info("prefix_index_rebuilt", workers=len(self.loops))
            self.available = True
            return

    async def _rebuild(self) -> None:
        # Drain every loop first (the snapshots below supersede the events), so that no
        # loop's events pile up while the index is down.
        snapshots = []
        for loop in self.loops:
            loop.drain_cache_events()
            snapshots.append((self.ref(loop), loop.cached_block_hashes()))
        for ref, hashes in snapshots:
            await self.index.replace_worker(ref, hashes)
