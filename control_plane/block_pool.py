"""The pools under the block manager: a free-block queue in eviction order, per-block
refcounts, and on the GPU the prefix cache's hash <-> block maps and their change events.

    pool:  refcount[block]  +  free queue [ front: next allocated / evicted ... back ]
           + cached: block hash -> block id, meta: block id -> (hash, parent, token ids)

A block with refcount 0 is in the free queue; if it has a hash it stays findable there until
allocation pops it, which evicts the hash (a BlockRemoved event).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from control_plane.block_hash import BlockHash


class FreeBlockQueue:
    """Free block ids in eviction order; pop-front, append and remove-from-middle are O(1)."""

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._queue

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def popleft(self) -> int:
        block_id, _ = self._queue.popitem(last=False)
        return block_id

    def append(self, block_id: int) -> None:
        assert block_id not in self._queue, f"block {block_id} is already free"
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]


# -- prefix-cache events (for the cluster-wide prefix index) --------------------------------------


@dataclass(frozen=True)
class BlockStored:
    """A block became findable under block_hash; parent_block_hash is its chain predecessor."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None


@dataclass(frozen=True)
class BlockRemoved:
    """The block cached under block_hash was evicted."""

    block_hash: BlockHash


@dataclass(frozen=True)
class AllBlocksCleared:
    """Forget every hash this block manager advertised; the events after it restate the cache."""


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a registered block holds; its tokens (`block_hash.token_bytes`) rule out hash
    collisions on a hit. One per cached block, so kept small: ~270 bytes with 16 tokens."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    tokens: bytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 8


@dataclass(frozen=True)
class PrefixCacheStats:
    """queries/hits count admitted requests (hits: at least one cached block); the token
    counts are the requests' lengths and their cached tokens."""

    num_queries: int = 0
    num_hits: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_cached_blocks: int = 0
    num_evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class BlockPool:
    """Refcounts and a free queue for `num_blocks` block ids 0..num_blocks-1, and the prefix
    cache over them: hash -> block and block -> CachedBlock, for free and used blocks alike."""

    def __init__(self, name: str, num_blocks: int, max_pending_events: int = 0) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.refcounts = [0] * num_blocks
        self.free_queue = FreeBlockQueue(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.meta: dict[int, CachedBlock] = {}
        self.num_evicted = 0
        # Past this many undrained events, keep none and restate the whole cache on drain.
        self._max_pending_events = max_pending_events
        self._events: list[BlockEvent] = []
        self._events_lost = False

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        """Pop n blocks from the front of the free queue (refcount 1), evicting their hashes;
        None, changing nothing, if too few are free."""
        if n > len(self.free_queue):
            return None
        block_ids = [self.free_queue.popleft() for _ in range(n)]
        for b in block_ids:
            self.refcounts[b] = 1
            if (meta := self.meta.pop(b, None)) is not None:
                del self.cached[meta.block_hash]
                self.num_evicted += 1
                self._emit(BlockRemoved(meta.block_hash))
        return block_ids

    def take(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block; a free (cached) block leaves the free queue."""
        for b in block_ids:
            if self.refcounts[b] == 0:
                self.free_queue.remove(b)
            self.refcounts[b] += 1

    def incref(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            assert self.refcounts[b] > 0, f"{self.name} block {b} is not in use"
            self.refcounts[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, tail-first; unused blocks join the free queue."""
        for b in reversed(block_ids):
            assert self.refcounts[b] > 0, f"{self.name} block {b} released while free"
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self.free_queue.append(b)

    def register(self, block_id: int, meta: CachedBlock) -> None:
        """Make a used block findable under meta.block_hash. A block already registered keeps
        its entry; a hash already held by another block stays with that block."""
        assert self.refcounts[block_id] > 0, f"{self.name} block {block_id} registered while free"
        if (old := self.meta.get(block_id)) is not None:
            assert old.block_hash == meta.block_hash, f"block {block_id} changed its hash"
            return
        if meta.block_hash in self.cached:
            return
        self.cached[meta.block_hash] = block_id
        self.meta[block_id] = meta
        self._emit(BlockStored(meta.block_hash, meta.parent_block_hash))

    def _emit(self, event: BlockEvent) -> None:
        if self._events_lost:
            return
        if len(self._events) >= self._max_pending_events:
            self._events.clear()
            self._events_lost = True
            return
        self._events.append(event)

    def drain_events(self) -> list[BlockEvent]:
        if self._events_lost:
            self._events_lost = False
            restated = [BlockStored(m.block_hash, m.parent_block_hash) for m in self.meta.values()]
            return [AllBlocksCleared(), *restated]
        events, self._events = self._events, []
        return events

    def check_integrity(self, tables: Mapping[str, list[int]]) -> None:
        n = self.num_blocks
        refs: Counter[int] = Counter()
        for req_id, table in tables.items():
            assert len(set(table)) == len(table), f"{self.name}: {req_id} holds a block twice"
            refs.update(table)
        bad = [b for b in refs if not 0 <= b < n]
        assert not bad, f"{self.name}: tables reference unknown blocks {bad}"
        free = list(self.free_queue)
        assert len(set(free)) == len(free), f"{self.name}: a block is twice in the free queue"
        assert all(0 <= b < n for b in free), f"{self.name}: unknown block in the free queue"
        num_used = 0
        for b, rc in enumerate(self.refcounts):
            assert rc >= 0, f"{self.name} block {b}: refcount {rc} < 0"
            if b in self.free_queue:
                assert rc == 0, f"{self.name} block {b}: free with refcount {rc}"
            else:
                assert rc > 0, f"{self.name} block {b}: neither free nor referenced (leaked)"
                num_used += 1
            assert rc == refs[b], f"{self.name} block {b}: refcount {rc} but {refs[b]} tables"
        assert len(free) + num_used == n, (
            f"{self.name}: {len(free)} free + {num_used} used != {n} blocks"
        )
        assert len(self.cached) == len(self.meta), f"{self.name}: hash maps differ in size"
        for h, b in self.cached.items():
            assert 0 <= b < n, f"{self.name}: hash {h.hex()} maps to unknown block {b}"
            meta = self.meta.get(b)
            assert meta is not None and meta.block_hash == h, (
                f"{self.name} block {b}: hash maps disagree"
            )
