"""The cluster-wide prefix index: which workers hold the KV of which block hash.

It is a hint for placement, never a source of physical block ids: the block managers stay
authoritative. Two backends implement `PrefixIndex`: `MemoryPrefixIndex` (one process) and
`RedisPrefixIndex` (shared by control-plane replicas).

Redis layout, one hash per cached block:

    {prefix}:{model}:b:{block_hash_hex}  ->  { worker_id: epoch, ... }

A lookup is ONE round trip (a read-only Lua script): for every worker, the number of leading
blocks of the prompt whose entry carries that worker's current epoch. An entry with an older
epoch (the worker restarted and lost its cache) counts as absent, and is deleted by
`drop_stale` when the worker registers again.

A Redis that restarts (without persistence) or is flushed comes back empty, and the client
reconnects to it without an error. So that the control plane still notices, and rebuilds its
workers' entries, each index writes a key of its own when it is set up and after each outage,

    {prefix}:{model}:live:{random}  ->  1

and both scripts first check it is there: when it is gone, the call raises
PrefixIndexUnavailable (one key read per call, in the same round trip).
"""

from __future__ import annotations

import asyncio
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pagedserve.log import get_logger

log = get_logger(__name__)

# Both scripts return LOST when the index's live key is gone (Redis lost its data).
LOST = -1

# Read-only: KEYS = the live key, then block keys in prompt order; ARGV = whether to check
# the live key ("1"), then worker_id_1, epoch_1, worker_id_2, ...
_LOOKUP_LUA = """
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local result = {}
for w = 2, #ARGV, 2 do
  local worker, epoch = ARGV[w], ARGV[w + 1]
  local n = 0
  for i = 2, #KEYS do
    if redis.call('HGET', KEYS[i], worker) ~= epoch then break end
    n = i - 1
  end
  result[#result + 1] = n
end
return result
"""

# KEYS = the live key, then the removed blocks' keys, then the stored blocks'; ARGV = worker_id,
# epoch, TTL seconds, the number of removed keys, "1" to set the live key (else it must be
# there). One call per batch of events: as a pipeline of HDEL / HSET + EXPIRE commands, the
# client's Python cost 14x as much CPU per event.
_UPDATE_LUA = """
if ARGV[5] == '1' then
  redis.call('SET', KEYS[1], 1, 'EX', ARGV[3])
elseif redis.call('EXPIRE', KEYS[1], ARGV[3]) == 0 then
  return -1
end
local removed = tonumber(ARGV[4]) + 1
for i = 2, #KEYS do
  if i <= removed then
    redis.call('HDEL', KEYS[i], ARGV[1])
  else
    redis.call('HSET', KEYS[i], ARGV[1], ARGV[2])
    redis.call('EXPIRE', KEYS[i], ARGV[3])
  end
end
return #KEYS - 1
"""
# Keys per update call: a script holds the server for its whole run, and other replicas'
# lookups wait behind it.
UPDATE_BATCH = 2048


@dataclass(frozen=True)
class WorkerRef:
    worker_id: str
    epoch: int


class PrefixIndexUnavailable(RuntimeError):
    """The index could not answer; placement falls back to load alone."""


class PrefixIndexTimeout(PrefixIndexUnavailable):
    """One lookup missed its deadline; the index itself is presumed fine."""


class PrefixIndexLost(PrefixIndexUnavailable):
    """The index answers but lost its entries (Redis restarted or was flushed)."""


class PrefixIndex(ABC):
    """Contract: `lookup` returns, per worker, how many leading blocks of `block_hashes` that
    worker holds (at its current epoch); `update` records blocks stored on / removed from a
    worker; `replace_worker` makes the index hold exactly `hashes` for that worker. Methods
    may raise PrefixIndexUnavailable; callers degrade, they never fail a request for it."""

    @abstractmethod
    async def lookup(
        self, block_hashes: Sequence[bytes], workers: Sequence[WorkerRef]
    ) -> dict[str, int]: ...

    @abstractmethod
    async def update(
        self, worker: WorkerRef, stored: Sequence[bytes], removed: Sequence[bytes]
    ) -> None: ...

    @abstractmethod
    async def replace_worker(self, worker: WorkerRef, hashes: Sequence[bytes]) -> None: ...

    async def check(self) -> None:  # noqa: B027 - optional hook
        """Raises PrefixIndexUnavailable when the index cannot answer or lost its entries
        (called while nothing else asks it, so that an outage is noticed then too)."""

    async def reconnect(self) -> None:  # noqa: B027 - optional hook
        """Called before the index is rebuilt after an outage (PrefixIndexUnavailable): drop
        what the outage broke."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryPrefixIndex(PrefixIndex):
    def __init__(self) -> None:
        self._blocks: dict[bytes, dict[str, int]] = {}

    async def lookup(
        self, block_hashes: Sequence[bytes], workers: Sequence[WorkerRef]
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in workers:
            n = 0
            for h in block_hashes:
                if self._blocks.get(h, {}).get(w.worker_id) != w.epoch:
                    break
                n += 1
            out[w.worker_id] = n
        return out

    async def update(
        self, worker: WorkerRef, stored: Sequence[bytes], removed: Sequence[bytes]
    ) -> None:
        for h in removed:
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(worker.worker_id, None)
                if not holders:
                    del self._blocks[h]
        for h in stored:
            self._blocks.setdefault(h, {})[worker.worker_id] = worker.epoch

    async def replace_worker(self, worker: WorkerRef, hashes: Sequence[bytes]) -> None:
        for holders in self._blocks.values():
            holders.pop(worker.worker_id, None)
        self._blocks = {h: v for h, v in self._blocks.items() if v}
        await self.update(worker, hashes, ())


class RedisPrefixIndex(PrefixIndex):
    def __init__(
        self,
        url: str,
        model: str,
        *,
        prefix: str = "pagedserve",
        timeout_s: float = 0.05,
        ttl_s: int = 24 * 3600,
    ) -> None:
        # Lookups sit on a request's path and get a tight deadline; writes are batched off
        # the critical path and may take longer.
        self._redis = aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._timeout_s = timeout_s
        self._ns = f"{prefix}:{model}:b:"
        self._live = f"{prefix}:{model}:live:{secrets.token_hex(8)}"
        self._armed = False  # the live key has been written: its absence means a loss
        self._ttl_s = ttl_s
        self._lookup = self._redis.register_script(_LOOKUP_LUA)
        self._update = self._redis.register_script(_UPDATE_LUA)

    def _key(self, h: bytes) -> str:
        return self._ns + h.hex()

    async def lookup(
        self, block_hashes: Sequence[bytes], workers: Sequence[WorkerRef]
    ) -> dict[str, int]:
        if not block_hashes or not workers:
            return {w.worker_id: 0 for w in workers}
        argv: list[str] = ["1" if self._armed else "0"]
        for w in workers:
            argv += [w.worker_id, str(w.epoch)]
        try:
            counts = await asyncio.wait_for(
                self._lookup(keys=[self._live, *map(self._key, block_hashes)], args=argv),
                self._timeout_s,
            )
        except TimeoutError as exc:
            raise PrefixIndexTimeout(f"lookup took over {self._timeout_s * 1000:.0f} ms") from exc
        except (RedisError, OSError) as exc:
            raise PrefixIndexUnavailable(str(exc)) from exc
        if counts == LOST:
            raise PrefixIndexLost("Redis lost the index (restarted or flushed)")
        return {w.worker_id: int(n) for w, n in zip(workers, counts, strict=True)}

    async def update(
        self, worker: WorkerRef, stored: Sequence[bytes], removed: Sequence[bytes]
    ) -> None:
        if not stored and not removed:
            return
        # Removals first: a block evicted and cached again in one batch stays recorded.
        keys = [self._key(h) for h in removed] + [self._key(h) for h in stored]
        num_removed = len(removed)
        try:
            for start in range(0, len(keys), UPDATE_BATCH):
                batch_removed = min(max(num_removed - start, 0), UPDATE_BATCH)
                args: list[str | int] = [
                    worker.worker_id,
                    str(worker.epoch),
                    self._ttl_s,
                    batch_removed,
                    "0" if self._armed else "1",
                ]
                batch = [self._live, *keys[start : start + UPDATE_BATCH]]
                if await self._update(keys=batch, args=args) == LOST:
                    raise PrefixIndexLost("Redis lost the index (restarted or flushed)")
                self._armed = True
        except (TimeoutError, RedisError, OSError) as exc:
            raise PrefixIndexUnavailable(str(exc)) from exc

    async def replace_worker(self, worker: WorkerRef, hashes: Sequence[bytes]) -> None:
        """Drops every entry of this worker (any epoch), then records `hashes`."""
        try:
            async for key in self._redis.scan_iter(match=self._ns + "*", count=1000):
                await self._redis.hdel(key, worker.worker_id)
        except (TimeoutError, RedisError, OSError) as exc:
            raise PrefixIndexUnavailable(str(exc)) from exc
        await self.update(worker, hashes, ())

    async def reconnect(self) -> None:
        """Drops every pooled connection (each one died with the server: on first use it would
        fail and retry with a backoff, past a lookup's deadline) and loads the scripts
        into the restarted server, so the first lookups after an outage are not slow ones."""
        try:
            await self._redis.connection_pool.disconnect()
            await self._redis.script_load(_LOOKUP_LUA)
            await self._redis.script_load(_UPDATE_LUA)
            # From here the rebuild's writes count: a loss during it is noticed too.
            await self._redis.set(self._live, 1, ex=self._ttl_s)
        except (TimeoutError, RedisError, OSError) as exc:
            raise PrefixIndexUnavailable(str(exc)) from exc
        self._armed = True

    async def check(self) -> None:
        try:
            there = await self._redis.exists(self._live) if self._armed else 1
        except (TimeoutError, RedisError, OSError) as exc:
            raise PrefixIndexUnavailable(str(exc)) from exc
        if not there:
            raise PrefixIndexLost("Redis lost the index (restarted or flushed)")

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (TimeoutError, RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._redis.aclose()
