"""The logical side of paging for one worker: which block ids each request holds.

    request ──▶ block table (list of block ids, one per block_size tokens)
                    │
                    ▼
    pool (GPU or CPU): refcount per block + free queue (eviction order)
                       + on the GPU, the prefix cache: block hash <-> block id

The worker owns the physical blocks; this module decides which ids are used, and the plan
tells the worker what to copy when blocks move between pools or diverge.

Prefix caching (GPU pool only). Once a running request has computed a full block, the block is
registered under its chained hash (`block_hash.py`). A request being admitted takes the longest
run of registered blocks matching its leading full blocks (`find_cached_prefix`) and computes
only the rest; the hit never covers the last token, so the request has something to sample
from. Freed blocks keep their hash and stay findable in the free queue until allocation pops
them (LRU), which evicts the hash. Each registration and eviction is recorded as an event for
the cluster-wide prefix index (`drain_events`).

    free queue:  [ front: next allocated / evicted ......... back: most recently freed ]

A request's blocks are released tail-first, so the blocks near the start of a prompt (the most
shareable) are evicted last.

Sharing and copy-on-write: `fork` lets a child reference all of a parent's blocks (refcount
+ 1), and hits share cached blocks. Shared blocks are read-only: `reserve_slots`, asked to make
token slots writable, gives the request a fresh copy of every shared block in the written range
and returns the copy ops; the last holder (refcount 1) writes in place. In practice the only
block ever copied is the partially filled last block of a fork, on each child's first write
into it (the last child to write finds refcount 1 and keeps it). Beam search re-forks at every
step: `reassign` gives each next beam its source beam's table, and unselected tables are
released. Swapping moves a request, or a group of requests at once: each distinct block gets
one block in the other pool, so blocks shared within the group stay shared (two requests
swapped out separately hold separate copies).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from control_plane.block_hash import BlockHash, token_bytes
from control_plane.block_pool import (
    AllBlocksCleared,
    BlockEvent,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CachedBlock,
    FreeBlockQueue,
    PrefixCacheStats,
)
from control_plane.request import Request
from pagedserve.plan import BlockMove


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks a request can start from: its first len(block_ids) blocks, num_tokens
    tokens. num_query_tokens is the request's length when it was looked up."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_query_tokens: int = 0


@dataclass
class SlotReservation:
    """What `reserve_slots` did: blocks appended to the table, and copy-on-write ops (src, dst)
    whose dst replaced src in the table."""

    new_block_ids: list[int] = field(default_factory=list)
    copies: list[BlockMove] = field(default_factory=list)


# What most reservations are: nothing appended, nothing copied (shared: never mutated).
_IN_PLACE = SlotReservation()


class BlockManager:
    """Block tables, refcounts and free queues for one worker's GPU and CPU (swap) pools, and
    the prefix cache over the GPU pool."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_pending_events: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if max_pending_events is None:
            max_pending_events = 2 * num_gpu_blocks + 1024
        self.gpu = BlockPool("gpu", num_gpu_blocks, max_pending_events)
        self.cpu = BlockPool("cpu", num_cpu_blocks)
        self._gpu_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}
        # request -> how many leading blocks of its GPU table were offered to the prefix cache
        self._num_offered: dict[str, int] = {}
        self._stats = Counter[str]()

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks in use, in [0, 1]; cached free blocks count as free."""
        return _usage(self.gpu)

    @property
    def cpu_usage(self) -> float:
        return _usage(self.cpu)

    @property
    def num_gpu_block_refs(self) -> int:
        """GPU blocks summed over all tables: what the used blocks would be without sharing."""
        return sum(self.gpu.refcounts)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's GPU block table (a copy); empty if it holds no GPU blocks."""
        return list(self._gpu_tables.get(req_id, ()))

    def get_cpu_block_ids(self, req_id: str) -> list[int]:
        return list(self._cpu_tables.get(req_id, ()))

    def is_swapped(self, req_id: str) -> bool:
        return req_id in self._cpu_tables

    def request_ids(self) -> set[str]:
        """Every request that holds a table, in either pool."""
        return set(self._gpu_tables) | set(self._cpu_tables)

    def free_gpu_block_ids(self) -> list[int]:
        """The GPU free queue, front (next allocated) first."""
        return list(self.gpu.free_queue)

    def free_cpu_block_ids(self) -> list[int]:
        return list(self.cpu.free_queue)

    # -- prefix cache -----------------------------------------------------------------------

    def find_cached_prefix(self, req: Request) -> PrefixHit:
        """The longest run of cached blocks equal to the request's leading full blocks, capped
        so that its last token is left to compute. Changes nothing but req.block_hashes."""
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            # Prompt logprobs come from computing the prompt: a hit would skip them.
            return PrefixHit(num_query_tokens=req.num_tokens)
        bs = self.block_size
        req.extend_block_hashes(bs)
        block_ids: list[int] = []
        for i, h in enumerate(req.block_hashes[: (req.num_tokens - 1) // bs]):
            b = self.gpu.cached.get(h)
            if b is None or self.gpu.meta[b].tokens != token_bytes(
                req.token_ids_slice(i * bs, (i + 1) * bs)
            ):
                break  # a miss, or a hash collision
            block_ids.append(b)
        return PrefixHit(tuple(block_ids), len(block_ids) * bs, req.num_tokens)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's computed full GPU blocks not registered yet (call after its
        num_computed_tokens grew)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = self._num_offered.get(req.req_id, 0)
        if req.num_computed_tokens // bs <= start:
            return  # no block filled since the last call: the common decode step
        table = self._gpu_tables.get(req.req_id)
        if table is None:
            return
        req.extend_block_hashes(bs)
        end = min(req.num_computed_tokens // bs, len(req.block_hashes), len(table))
        for i in range(start, end):
            parent = req.block_hashes[i - 1] if i else None
            tokens = token_bytes(req.token_ids_slice(i * bs, (i + 1) * bs))
            self.gpu.register(table[i], CachedBlock(req.block_hashes[i], parent, tokens))
        self._num_offered[req.req_id] = max(start, end)

    def drain_events(self) -> list[BlockEvent]:
        """Prefix-cache events since the last drain, oldest first. If too many piled up, they
        are replaced by AllBlocksCleared followed by a BlockStored for every cached block."""
        return self.gpu.drain_events()

    def cached_prefix_hashes(self) -> list[BlockHash]:
        """Every hash currently findable in the prefix cache (to rebuild an index)."""
        return list(self.gpu.cached)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        s = self._stats
        return PrefixCacheStats(
            num_queries=s["queries"],
            num_hits=s["hits"],
            num_query_tokens=s["query_tokens"],
            num_hit_tokens=s["hit_tokens"],
            num_cached_blocks=len(self.gpu.cached),
            num_evicted_blocks=self.gpu.num_evicted,
        )

    # -- allocation -------------------------------------------------------------------------

    def num_blocks_to_allocate(self, req_id: str, num_tokens_total: int) -> int:
        """How many blocks `allocate_slots(req_id, num_tokens_total)` would append."""
        table = self._gpu_tables.get(req_id) or self._cpu_tables.get(req_id) or []
        held = len(table)
        return max(0, self.num_blocks_for(num_tokens_total) - held)

    def allocate_slots(
        self, req_id: str, num_tokens_total: int, prefix: PrefixHit | None = None
    ) -> list[int] | None:
        """Grow the request's GPU table to cover `num_tokens_total` token slots.

        With `prefix` (from `find_cached_prefix` just before, for a request holding no blocks),
        the table starts with the prefix's cached blocks, and the lookup counts as a query.
        Returns the newly allocated block ids (possibly none), or None, changing nothing, when
        the free queue is too short. Never shrinks a table.
        """
        if num_tokens_total < 0:
            raise ValueError(f"num_tokens_total must be >= 0, got {num_tokens_total}")
        if req_id in self._cpu_tables:
            raise ValueError(f"request {req_id} is swapped out; swap it in first")
        if prefix is None:
            new_blocks = self.gpu.allocate(self.num_blocks_to_allocate(req_id, num_tokens_total))
            if new_blocks is None:
                return None
            self._gpu_tables.setdefault(req_id, []).extend(new_blocks)
            return new_blocks
        if req_id in self._gpu_tables:
            raise ValueError(f"request {req_id} already holds blocks; a prefix starts a table")
        assert num_tokens_total >= prefix.num_tokens, "slots must cover the cached prefix"
        assert all(b in self.gpu.meta for b in prefix.block_ids), "stale prefix hit"
        num_new = self.num_blocks_for(num_tokens_total) - len(prefix.block_ids)
        reclaimed = sum(self.gpu.refcounts[b] == 0 for b in prefix.block_ids)
        if num_new > self.gpu.num_free - reclaimed:
            return None
        self.gpu.take(prefix.block_ids)
        new_blocks = self.gpu.allocate(num_new)
        assert new_blocks is not None
        self._gpu_tables[req_id] = [*prefix.block_ids, *new_blocks]
        self._num_offered[req_id] = len(prefix.block_ids)
        if self.enable_prefix_caching:
            self._stats.update(
                queries=1,
                hits=int(bool(prefix.block_ids)),
                query_tokens=prefix.num_query_tokens,
                hit_tokens=prefix.num_tokens,
            )
        return new_blocks

    def reserve_slots(
        self, req_id: str, num_computed_tokens: int, num_tokens_total: int
    ) -> SlotReservation | None:
        """Make token slots [num_computed_tokens, num_tokens_total) of the request writable:
        copy-on-write every shared block (refcount > 1) in that range, then grow the table.

        Copies are allocated first, in table order, then the appended blocks. Each copied
        block's source loses this request's reference and keeps its other holders. None,
        changing nothing, when the free queue is too short.
        """
        bs = self.block_size
        table = self._gpu_tables.get(req_id)
        if (
            table is not None
            and num_computed_tokens < num_tokens_total <= len(table) * bs
            and num_computed_tokens // bs == (num_tokens_total - 1) // bs
            and self.gpu.refcounts[table[num_computed_tokens // bs]] == 1
        ):
            # The common decode step: the slots lie in one block the request owns alone.
            return _IN_PLACE
        if req_id in self._cpu_tables:
            raise ValueError(f"request {req_id} is swapped out; swap it in first")
        table = table or []
        end = min(self.num_blocks_for(num_tokens_total), len(table))
        written = range(
            num_computed_tokens // bs, end if num_tokens_total > num_computed_tokens else 0
        )
        shared = [i for i in written if self.gpu.refcounts[table[i]] > 1]
        num_new = self.num_blocks_to_allocate(req_id, num_tokens_total)
        if len(shared) + num_new > self.gpu.num_free:
            return None
        copies: list[BlockMove] = []
        for i, dst in zip(shared, self.gpu.allocate(len(shared)) or [], strict=True):
            self.gpu.refcounts[table[i]] -= 1  # still > 0: another holder remains
            copies.append(BlockMove(table[i], dst))
            table[i] = dst
        new_blocks = self.allocate_slots(req_id, num_tokens_total)
        assert new_blocks is not None
        return SlotReservation(new_blocks, copies)

    def num_blocks_to_reserve(self, ranges: list[tuple[str, int, int]]) -> int:
        """Free blocks that `reserve_slots` would take for each (req_id, num_computed_tokens,
        num_tokens_total) in turn: copies of shared blocks (the last holder writing in place)
        and appended blocks; for swapped requests, once swapped in."""
        bs = self.block_size
        refcounts: dict[tuple[bool, int], int] = {}
        total = 0
        for req_id, start, end in ranges:
            # A swapped request's table counts as it will be on the GPU (sharing kept).
            in_cpu = req_id in self._cpu_tables
            table = (self._cpu_tables if in_cpu else self._gpu_tables).get(req_id, [])
            pool = self.cpu if in_cpu else self.gpu
            for i in range(start // bs, min(self.num_blocks_for(end), len(table))):
                b = (in_cpu, table[i])
                rc = refcounts.get(b, pool.refcounts[table[i]])
                if rc > 1:
                    total += 1
                    refcounts[b] = rc - 1
            total += self.num_blocks_to_allocate(req_id, end)
        return total

    def free(self, req_id: str) -> None:
        """Release the request's blocks in whichever pool holds them; unknown ids are a no-op.
        Cached blocks stay findable until they are reallocated."""
        self._num_offered.pop(req_id, None)
        if (table := self._gpu_tables.pop(req_id, None)) is not None:
            self.gpu.release(table)
        if (table := self._cpu_tables.pop(req_id, None)) is not None:
            self.cpu.release(table)

    def fork(self, parent_req_id: str, child_req_id: str, num_blocks: int | None = None) -> None:
        """Give the child a table sharing every block of the parent's (refcount + 1), or its
        first num_blocks.

        The child lives in the parent's pool. Shared blocks are read-only: write through
        `reserve_slots`, which copies a shared block before the first write into it.
        """
        if child_req_id in self._gpu_tables or child_req_id in self._cpu_tables:
            raise ValueError(f"request {child_req_id} already holds blocks")
        pool, tables = (
            (self.cpu, self._cpu_tables)
            if parent_req_id in self._cpu_tables
            else (self.gpu, self._gpu_tables)
        )
        table = tables.get(parent_req_id, [])[:num_blocks]
        pool.incref(table)
        tables[child_req_id] = list(table)
        if parent_req_id in self._num_offered:
            self._num_offered[child_req_id] = min(self._num_offered[parent_req_id], len(table))

    def reassign(self, sources: dict[str, str]) -> None:
        """Each key's table becomes a copy of its value's table as it was before any of them
        changed (beam search: next beam <- the beam it extends). Every key's and value's old
        table is released, after the new ones took their references, so blocks no new table
        holds go back to the free queue. The tables live in whichever pool holds the sources;
        requests holding no blocks (waiting) stay without."""
        if not sources:
            return
        in_cpu = any(src in self._cpu_tables for src in sources.values())
        pool, tables = (self.cpu, self._cpu_tables) if in_cpu else (self.gpu, self._gpu_tables)
        new = {dst: list(tables[src]) for dst, src in sources.items() if src in tables}
        offered = {
            dst: self._num_offered[src] for dst, src in sources.items() if src in self._num_offered
        }
        for table in new.values():
            pool.incref(table)
        for req_id in {*sources, *sources.values()}:
            if (old := tables.pop(req_id, None)) is not None:
                pool.release(old)
            self._num_offered.pop(req_id, None)
        tables.update(new)
        if not in_cpu:
            self._num_offered.update(offered)

    # -- swapping ---------------------------------------------------------------------------

    def swap_out(self, req_ids: str | list[str]) -> list[BlockMove] | None:
        """Move the blocks of a request, or of a group of requests together, GPU → CPU; moves
        are (gpu_block, cpu_block), one per distinct block, in table order.

        None, changing nothing, if the CPU pool lacks free blocks. The GPU blocks are released
        tail-first and may be reused in the same step: the worker swaps out before reusing.
        """
        ids = [req_ids] if isinstance(req_ids, str) else req_ids
        if swapped := [r for r in ids if r in self._cpu_tables]:
            raise ValueError(f"request {swapped[0]} is already swapped out")
        moves = self._move(ids, self.gpu, self._gpu_tables, self.cpu, self._cpu_tables)
        if moves is not None:
            for r in ids:
                self._num_offered.pop(r, None)
        return moves

    def can_swap_in(
        self, req_ids: str | list[str], num_tokens_total: int = 0, extra_blocks: int = 0
    ) -> bool:
        """True if the swapped request's blocks (a group's distinct blocks), plus the blocks
        each would need to cover `num_tokens_total` slots, plus extra_blocks, fit in the free
        GPU blocks."""
        ids = [req_ids] if isinstance(req_ids, str) else req_ids
        if any(r not in self._cpu_tables for r in ids):
            return False
        distinct = {b for r in ids for b in self._cpu_tables[r]}
        grow = sum(self.num_blocks_to_allocate(r, num_tokens_total) for r in ids)
        return len(distinct) + grow + extra_blocks <= self.gpu.num_free

    def swap_in(self, req_ids: str | list[str]) -> list[BlockMove] | None:
        """Move the blocks of a request, or of a group together, CPU → GPU; moves are
        (cpu_block, gpu_block), one per distinct block, in table order.

        None, changing nothing, if the GPU pool lacks free blocks. The new GPU blocks are
        offered to the prefix cache again by the next `cache_full_blocks`.
        """
        ids = [req_ids] if isinstance(req_ids, str) else req_ids
        if missing := [r for r in ids if r not in self._cpu_tables]:
            raise ValueError(f"request {missing[0]} is not swapped out")
        return self._move(ids, self.cpu, self._cpu_tables, self.gpu, self._gpu_tables)

    def _move(
        self,
        req_ids: list[str],
        src: BlockPool,
        src_tables: dict[str, list[int]],
        dst: BlockPool,
        dst_tables: dict[str, list[int]],
    ) -> list[BlockMove] | None:
        tables = [src_tables.get(r, []) for r in req_ids]
        distinct = list(dict.fromkeys(b for t in tables for b in t))
        new_blocks = dst.allocate(len(distinct))
        if new_blocks is None:
            return None
        mapping = dict(zip(distinct, new_blocks, strict=True))
        for r, table in zip(req_ids, tables, strict=True):
            src_tables.pop(r, None)
            src.release(table)
            dst_tables[r] = [mapping[b] for b in table]
        # allocate() gave each block one reference: add the group's other holders.
        held = Counter(b for t in tables for b in t)
        dst.incref(mapping[b] for b, n in held.items() for _ in range(n - 1))
        return [BlockMove(s, d) for s, d in mapping.items()]

    # -- invariants -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, if the bookkeeping is inconsistent."""
        both = set(self._gpu_tables) & set(self._cpu_tables)
        assert not both, f"requests hold blocks in both pools: {sorted(both)}"
        self.gpu.check_integrity(self._gpu_tables)
        self.cpu.check_integrity(self._cpu_tables)
        assert not self.cpu.cached, "the CPU pool has no prefix cache"
        assert self.enable_prefix_caching or not self.gpu.cached, "caching is off, blocks cached"
        for b, meta in self.gpu.meta.items():
            assert meta.num_tokens == self.block_size, f"gpu block {b} caches a partial block"
        for req_id, n in self._num_offered.items():
            table = self._gpu_tables.get(req_id)
            assert table is not None and n <= len(table), f"{req_id}: offered {n} blocks"


def _usage(pool: BlockPool) -> float:
    if pool.num_blocks == 0:
        return 0.0
    return 1.0 - pool.num_free / pool.num_blocks


__all__ = [
    "AllBlocksCleared",
    "BlockEvent",
    "BlockManager",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CachedBlock",
    "FreeBlockQueue",
    "PrefixCacheStats",
    "PrefixHit",
    "SlotReservation",
]
