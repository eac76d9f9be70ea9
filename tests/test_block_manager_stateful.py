"""Random sequences of admit (with cached-prefix reuse) / write (with copy-on-write) / sample /
grow / free / preempt / swap / fork on the block manager, checked after every step against
`check_integrity()`, a model of the blocks' contents and a replay of the prefix-cache events.

The content model stores, per physical slot, the token sequence up to and including the token
written there (what a real K/V depends on). Every request's computed tokens must read back
through its table, and every cached block, used or free, must still hold the tokens it is
registered for.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from control_plane.block_hash import token_bytes
from control_plane.block_manager import BlockManager, BlockRemoved, BlockStored
from control_plane.request import Request
from pagedserve.sampling_params import SamplingParams

Slot = tuple[int, ...] | None  # the tokens up to the one whose K/V the slot holds
BASE = [7, 8, 9, 10, 11, 12, 13, 14]  # a common prompt start, so that prefixes are shared


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1, 1)
        self.reqs: dict[str, Request] = {}
        self.slots: dict[str, int] = {}  # request -> token slots it asked for
        self.gpu: list[list[Slot]] = []
        self.cpu: list[list[Slot]] = []
        self.cached: set[bytes] = set()  # replayed from the events
        self.next_id = 0

    @initialize(
        num_gpu_blocks=st.integers(0, 12),
        num_cpu_blocks=st.integers(0, 8),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(
        self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, caching: bool
    ) -> None:
        self.bm = BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, caching)
        self.gpu = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]

    # -- helpers ----------------------------------------------------------------------------

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _pick(self, data: st.DataObject, swapped: bool | None = None) -> str:
        ids = sorted(r for r in self.slots if swapped is None or self.bm.is_swapped(r) == swapped)
        return data.draw(st.sampled_from(ids))

    def _gpu_reqs(self) -> bool:
        return any(not self.bm.is_swapped(r) for r in self.slots)

    def _cpu_reqs(self) -> bool:
        return any(self.bm.is_swapped(r) for r in self.slots)

    def _writable(self) -> list[str]:
        return sorted(
            r
            for r, req in self.reqs.items()
            if not self.bm.is_swapped(r) and req.num_computed_tokens < req.num_tokens
        )

    def _admit(self, req: Request, num_new: int) -> None:
        """Look the request up and allocate its cached prefix + num_new slots."""
        bm, bs = self.bm, self.bm.block_size
        free_before = bm.free_gpu_block_ids()
        hit = bm.find_cached_prefix(req)
        assert hit.num_tokens == len(hit.block_ids) * bs <= max(req.num_tokens - 1, 0)
        assert all(bm.gpu.meta[b].block_hash in self.cached for b in hit.block_ids)
        cap = (req.num_tokens - 1) // bs
        if bm.enable_prefix_caching and len(hit.block_ids) < cap:
            assert req.block_hashes[len(hit.block_ids)] not in self.cached  # longest run
        num_tokens = hit.num_tokens + min(num_new, req.num_tokens - hit.num_tokens)
        needed = bm.num_blocks_for(num_tokens) - len(hit.block_ids)
        reclaimed = [b for b in hit.block_ids if b in free_before]
        new = bm.allocate_slots(req.req_id, num_tokens, prefix=hit)
        if needed > len(free_before) - len(reclaimed):
            assert new is None and bm.free_gpu_block_ids() == free_before
            assert req.req_id not in bm.request_ids()
            return
        assert new == [b for b in free_before if b not in reclaimed][:needed]
        assert bm.get_block_ids(req.req_id) == [*hit.block_ids, *new]
        req.num_computed_tokens = hit.num_tokens
        self.reqs[req.req_id] = req
        self.slots[req.req_id] = num_tokens

    def _release(self, req_id: str) -> None:
        bm = self.bm
        swapped = bm.is_swapped(req_id)
        pool = bm.cpu if swapped else bm.gpu
        table = bm.get_cpu_block_ids(req_id) if swapped else bm.get_block_ids(req_id)
        free_before = list(pool.free_queue)
        last_refs = [b for b in reversed(table) if pool.refcounts[b] == 1]
        bm.free(req_id)
        assert list(pool.free_queue) == free_before + last_refs
        assert req_id not in bm.request_ids()

    # -- rules ------------------------------------------------------------------------------

    @rule(
        shared=st.integers(0, len(BASE)),
        tail=st.lists(st.integers(0, 3), max_size=6),
        num_new=st.integers(0, 20),
    )
    def admit(self, shared: int, tail: list[int], num_new: int) -> None:
        tokens = BASE[:shared] + tail or [0]
        self._admit(Request(self._new_id(), tokens, SamplingParams()), num_new)

    @precondition(lambda self: bool(self._writable()))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """Compute some of a request's tokens, copying shared blocks first."""
        req = self.reqs[data.draw(st.sampled_from(self._writable()))]
        bm, bs = self.bm, self.bm.block_size
        start = req.num_computed_tokens
        end = start + data.draw(st.integers(1, req.num_tokens - start))
        table, free_before = bm.get_block_ids(req.req_id), bm.free_gpu_block_ids()
        shared = [
            i
            for i in range(start // bs, min(bm.num_blocks_for(end), len(table)))
            if bm.gpu.refcounts[table[i]] > 1
        ]
        num_new = max(0, bm.num_blocks_for(end) - len(table))
        slots = bm.reserve_slots(req.req_id, start, end)
        if len(shared) + num_new > len(free_before):
            assert slots is None and bm.get_block_ids(req.req_id) == table
            assert bm.free_gpu_block_ids() == free_before
            return
        assert slots is not None
        assert [m.src for m in slots.copies] == [table[i] for i in shared]
        assert [m.dst for m in slots.copies] + slots.new_block_ids == free_before[
            : len(shared) + num_new
        ]
        for m in slots.copies:
            self.gpu[m.dst] = list(self.gpu[m.src])
        table = bm.get_block_ids(req.req_id)
        tokens = req.all_token_ids
        for pos in range(start, end):
            block = table[pos // bs]
            assert bm.gpu.refcounts[block] == 1, "a write into a shared block"
            assert bm.gpu.meta.get(block) is None, "a write into a cached block"
            self.gpu[block][pos % bs] = tuple(tokens[: pos + 1])
        req.num_computed_tokens = end
        self.slots[req.req_id] = max(self.slots[req.req_id], end)
        bm.cache_full_blocks(req)

    @precondition(
        lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.reqs.values())
    )
    @rule(data=st.data(), token=st.integers(0, 3))
    def sample(self, data: st.DataObject, token: int) -> None:
        done = sorted(
            r for r, req in self.reqs.items() if req.num_computed_tokens == req.num_tokens
        )
        self.reqs[data.draw(st.sampled_from(done))].output_token_ids.append(token)

    @precondition(_gpu_reqs)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def grow(self, data: st.DataObject, extra: int) -> None:
        """Reserve slots ahead of the tokens, as for a chunk not sampled yet."""
        req_id = self._pick(data, swapped=False)
        bm = self.bm
        before, free_before = bm.get_block_ids(req_id), bm.free_gpu_block_ids()
        num_tokens = self.slots[req_id] + extra
        needed = max(0, bm.num_blocks_for(num_tokens) - len(before))
        new = bm.allocate_slots(req_id, num_tokens)
        if needed > len(free_before):
            assert new is None
            assert bm.get_block_ids(req_id) == before and bm.free_gpu_block_ids() == free_before
            return
        assert new == free_before[:needed]
        assert bm.get_block_ids(req_id) == before + new
        self.slots[req_id] = num_tokens

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req_id = self._pick(data)
        self._release(req_id)
        del self.slots[req_id], self.reqs[req_id]

    @precondition(_gpu_reqs)
    @rule(data=st.data(), num_new=st.integers(0, 20))
    def preempt_recompute(self, data: st.DataObject, num_new: int) -> None:
        """Free everything, then readmit from the cache, as a recomputed request does."""
        req = self.reqs.pop(req_id := self._pick(data, swapped=False))
        del self.slots[req_id]
        self._release(req_id)
        req.num_computed_tokens = 0
        self._admit(req, num_new)

    @precondition(_gpu_reqs)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req_id = self._pick(data, swapped=False)
        bm = self.bm
        table, free_cpu = bm.get_block_ids(req_id), bm.free_cpu_block_ids()
        moves = bm.swap_out(req_id)
        if len(table) > len(free_cpu):
            assert moves is None and bm.get_block_ids(req_id) == table
            return
        assert moves is not None
        assert [m.src for m in moves] == table
        assert [m.dst for m in moves] == free_cpu[: len(table)] == bm.get_cpu_block_ids(req_id)
        for m in moves:
            self.cpu[m.dst] = list(self.gpu[m.src])

    @precondition(_cpu_reqs)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req_id = self._pick(data, swapped=True)
        bm = self.bm
        table, free_gpu = bm.get_cpu_block_ids(req_id), bm.free_gpu_block_ids()
        assert bm.can_swap_in(req_id) == (len(table) <= len(free_gpu))
        moves = bm.swap_in(req_id)
        if len(table) > len(free_gpu):
            assert moves is None and bm.get_cpu_block_ids(req_id) == table
            return
        assert moves is not None
        assert [m.src for m in moves] == table
        assert [m.dst for m in moves] == free_gpu[: len(table)] == bm.get_block_ids(req_id)
        for m in moves:
            self.gpu[m.dst] = list(self.cpu[m.src])

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.reqs[self._pick(data)]
        child = Request(
            self._new_id(),
            list(parent.prompt_token_ids),
            parent.sampling,
            output_token_ids=list(parent.output_token_ids),
            num_computed_tokens=parent.num_computed_tokens,
            block_hashes=list(parent.block_hashes),
        )
        self.bm.fork(parent.req_id, child.req_id)
        self.reqs[child.req_id] = child
        self.slots[child.req_id] = self.slots[parent.req_id]
        if self.bm.is_swapped(parent.req_id):
            assert self.bm.get_cpu_block_ids(child.req_id) == self.bm.get_cpu_block_ids(
                parent.req_id
            )
        else:
            assert self.bm.get_block_ids(child.req_id) == self.bm.get_block_ids(parent.req_id)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        bm = self.bm
        bm.check_integrity()
        assert bm.request_ids() == set(self.slots) == set(self.reqs)
        bs = bm.block_size
        for req_id, n in self.slots.items():
            table = bm.get_cpu_block_ids(req_id) or bm.get_block_ids(req_id)
            assert len(table) == -(-n // bs)

    @invariant()
    def contents_read_back(self) -> None:
        bs = self.bm.block_size
        for req_id, req in self.reqs.items():
            swapped = self.bm.is_swapped(req_id)
            pool = self.cpu if swapped else self.gpu
            table = self.bm.get_cpu_block_ids(req_id) if swapped else self.bm.get_block_ids(req_id)
            tokens = req.all_token_ids
            for pos in range(req.num_computed_tokens):
                assert pool[table[pos // bs]][pos % bs] == tuple(tokens[: pos + 1]), (req_id, pos)
        for b, meta in self.bm.gpu.meta.items():
            held = self.gpu[b]
            assert all(s is not None for s in held)
            assert token_bytes([s[-1] for s in held if s is not None]) == meta.tokens

    @invariant()
    def events_replay_to_the_cache(self) -> None:
        for event in self.bm.drain_events():
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.cached
                self.cached.add(event.block_hash)
            elif isinstance(event, BlockRemoved):
                self.cached.remove(event.block_hash)
            else:
                self.cached.clear()
        assert self.cached == set(self.bm.cached_prefix_hashes())


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
