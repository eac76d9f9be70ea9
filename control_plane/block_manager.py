"""The logical side of paging for one worker: which block ids each request holds.

    request ──▶ block table (list of block ids, one per block_size tokens)
                    │
                    ▼
    pool (GPU or CPU): refcount per block + free queue (eviction order)

The worker owns the physical blocks; this module decides which ids are used, and the plan
tells the worker what to copy when blocks move between pools. A request's blocks live in one
pool at a time: a GPU table while it can run, a CPU table while it is swapped out.

Free queue order matters. Allocation pops from the front; freed blocks join the back, a
request's blocks tail-first, so that once prefix caching keeps freed blocks evictable the
blocks near the start of a prompt (the most shareable) are evicted last.

Sharing: `fork` lets a child reference all of a parent's blocks (refcount + 1). Swapping a
request moves only that request: every block in its table gets a fresh block in the other
pool, including shared ones, whose source block stays with its other holders (refcount - 1).
Two requests sharing a block that are swapped out one after the other therefore hold two
separate copies in the CPU pool: correct refcounts, at the price of not preserving sharing
across a swap. Copy-on-write for a write into a shared last block is not done here yet.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from pagedserve.plan import BlockMove


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


class BlockPool:
    """Refcounts and a free queue for `num_blocks` block ids 0..num_blocks-1."""

    def __init__(self, name: str, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.refcounts = [0] * num_blocks
        self.free_queue = FreeBlockQueue(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        """Pop n blocks from the front of the free queue (refcount 1), or None if too few."""
        if n > len(self.free_queue):
            return None
        block_ids = [self.free_queue.popleft() for _ in range(n)]
        for b in block_ids:
            self.refcounts[b] = 1
        return block_ids

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


class BlockManager:
    """Block tables, refcounts and free queues for one worker's GPU and CPU (swap) pools."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.gpu = BlockPool("gpu", num_gpu_blocks)
        self.cpu = BlockPool("cpu", num_cpu_blocks)
        self._gpu_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}

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
        """Fraction of GPU blocks in use, in [0, 1]."""
        return _usage(self.gpu)

    @property
    def cpu_usage(self) -> float:
        return _usage(self.cpu)

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

    # -- allocation -------------------------------------------------------------------------

    def num_blocks_to_allocate(self, req_id: str, num_tokens_total: int) -> int:
        """How many blocks `allocate_slots(req_id, num_tokens_total)` would append."""
        table = self._gpu_tables.get(req_id) or self._cpu_tables.get(req_id) or []
        held = len(table)
        return max(0, self.num_blocks_for(num_tokens_total) - held)

    def allocate_slots(self, req_id: str, num_tokens_total: int) -> list[int] | None:
        """Grow the request's GPU table to cover `num_tokens_total` token slots.

        Returns the newly appended block ids (possibly none), or None, changing nothing, when
        the free queue is too short. Never shrinks a table.
        """
        if num_tokens_total < 0:
            raise ValueError(f"num_tokens_total must be >= 0, got {num_tokens_total}")
        if req_id in self._cpu_tables:
            raise ValueError(f"request {req_id} is swapped out; swap it in first")
        new_blocks = self.gpu.allocate(self.num_blocks_to_allocate(req_id, num_tokens_total))
        if new_blocks is None:
            return None
        self._gpu_tables.setdefault(req_id, []).extend(new_blocks)
        return new_blocks

    def free(self, req_id: str) -> None:
        """Release the request's blocks in whichever pool holds them; unknown ids are a no-op."""
        if (table := self._gpu_tables.pop(req_id, None)) is not None:
            self.gpu.release(table)
        if (table := self._cpu_tables.pop(req_id, None)) is not None:
            self.cpu.release(table)

    def fork(self, parent_req_id: str, child_req_id: str) -> None:
        """Give the child a table sharing every block of the parent's (refcount + 1).

        The child lives in the parent's pool. The caller must not let either side write into
        a shared, partially filled block until copy-on-write exists.
        """
        if child_req_id in self._gpu_tables or child_req_id in self._cpu_tables:
            raise ValueError(f"request {child_req_id} already holds blocks")
        pool, tables = (
            (self.cpu, self._cpu_tables)
            if parent_req_id in self._cpu_tables
            else (self.gpu, self._gpu_tables)
        )
        table = tables.get(parent_req_id, [])
        pool.incref(table)
        tables[child_req_id] = list(table)

    # -- swapping ---------------------------------------------------------------------------

    def swap_out(self, req_id: str) -> list[BlockMove] | None:
        """Move the request's blocks GPU → CPU; moves are (gpu_block, cpu_block) in table order.

        None, changing nothing, if the CPU pool lacks free blocks. The GPU blocks are released
        tail-first and may be reused in the same step: the worker swaps out before reusing.
        """
        if req_id in self._cpu_tables:
            raise ValueError(f"request {req_id} is already swapped out")
        return self._move(req_id, self.gpu, self._gpu_tables, self.cpu, self._cpu_tables)

    def can_swap_in(self, req_id: str, num_tokens_total: int = 0) -> bool:
        """True if the swapped request's blocks, plus the blocks it would need to cover
        `num_tokens_total` slots, fit in the free GPU blocks."""
        table = self._cpu_tables.get(req_id)
        if table is None:
            return False
        needed = len(table) + self.num_blocks_to_allocate(req_id, num_tokens_total)
        return needed <= self.gpu.num_free

    def swap_in(self, req_id: str) -> list[BlockMove] | None:
        """Move the request's blocks CPU → GPU; moves are (cpu_block, gpu_block) in table order.

        None, changing nothing, if the GPU pool lacks free blocks.
        """
        if req_id not in self._cpu_tables:
            raise ValueError(f"request {req_id} is not swapped out")
        return self._move(req_id, self.cpu, self._cpu_tables, self.gpu, self._gpu_tables)

    def _move(
        self,
        req_id: str,
        src: BlockPool,
        src_tables: dict[str, list[int]],
        dst: BlockPool,
        dst_tables: dict[str, list[int]],
    ) -> list[BlockMove] | None:
        table = src_tables.get(req_id, [])
        new_table = dst.allocate(len(table))
        if new_table is None:
            return None
        src_tables.pop(req_id, None)
        src.release(table)
        dst_tables[req_id] = new_table
        return [BlockMove(s, d) for s, d in zip(table, new_table, strict=True)]

    # -- invariants -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, if the bookkeeping is inconsistent."""
        both = set(self._gpu_tables) & set(self._cpu_tables)
        assert not both, f"requests hold blocks in both pools: {sorted(both)}"
        self.gpu.check_integrity(self._gpu_tables)
        self.cpu.check_integrity(self._cpu_tables)


def _usage(pool: BlockPool) -> float:
    if pool.num_blocks == 0:
        return 0.0
    return 1.0 - pool.num_free / pool.num_blocks
