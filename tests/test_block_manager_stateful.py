"""Random sequences of allocate / append / free / preempt / swap / fork on the block manager,
checked against a small model and `check_integrity()` after every step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from control_plane.block_manager import BlockManager


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1, 1)
        self.slots: dict[str, int] = {}  # request -> token slots it asked for
        self.next_id = 0

    @initialize(
        num_gpu_blocks=st.integers(0, 12),
        num_cpu_blocks=st.integers(0, 8),
        block_size=st.sampled_from([1, 2, 4]),
    )
    def setup(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_gpu_blocks, num_cpu_blocks, block_size)

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

    def _allocate(self, req_id: str, num_tokens: int) -> None:
        bm = self.bm
        before, free_before = bm.get_block_ids(req_id), bm.free_gpu_block_ids()
        needed = max(0, bm.num_blocks_for(num_tokens) - len(before))
        new = bm.allocate_slots(req_id, num_tokens)
        if needed > len(free_before):
            assert new is None
            assert bm.get_block_ids(req_id) == before and bm.free_gpu_block_ids() == free_before
            return
        assert new == free_before[:needed]
        assert bm.get_block_ids(req_id) == before + new
        self.slots[req_id] = max(self.slots.get(req_id, 0), num_tokens)

    @rule(num_tokens=st.integers(1, 20))
    def allocate(self, num_tokens: int) -> None:
        self._allocate(self._new_id(), num_tokens)

    @precondition(_gpu_reqs)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def append(self, data: st.DataObject, extra: int) -> None:
        req_id = self._pick(data, swapped=False)
        self._allocate(req_id, self.slots[req_id] + extra)

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req_id = self._pick(data)
        self._release(req_id)
        del self.slots[req_id]

    @precondition(_gpu_reqs)
    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        """Free everything, then ask again from nothing, as a readmitted request does."""
        req_id = self._pick(data, swapped=False)
        num_tokens = self.slots.pop(req_id)
        self._release(req_id)
        self._allocate(req_id, num_tokens)

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

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data)
        child = self._new_id()
        self.bm.fork(parent, child)
        self.slots[child] = self.slots[parent]
        if self.bm.is_swapped(parent):
            assert self.bm.get_cpu_block_ids(child) == self.bm.get_cpu_block_ids(parent)
        else:
            assert self.bm.get_block_ids(child) == self.bm.get_block_ids(parent)

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity()
        assert self.bm.request_ids() == set(self.slots)
        bs = self.bm.block_size
        for req_id, n in self.slots.items():
            table = self.bm.get_cpu_block_ids(req_id) or self.bm.get_block_ids(req_id)
            assert len(table) == -(-n // bs)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
