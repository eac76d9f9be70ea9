"""Exact block ids and free-queue order for the logical block manager."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from control_plane.block_manager import BlockManager, FreeBlockQueue
from pagedserve.plan import BlockMove


def test_free_queue_pop_append_remove_keep_order() -> None:
    q = FreeBlockQueue(range(5))
    assert q.popleft() == 0
    q.append(0)
    q.remove(3)
    assert list(q) == [1, 2, 4, 0]
    assert 3 not in q and len(q) == 4
    with pytest.raises(AssertionError):
        q.append(1)


def test_initial_state() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=3, block_size=4)
    assert bm.free_gpu_block_ids() == [0, 1, 2, 3, 4, 5]
    assert bm.free_cpu_block_ids() == [0, 1, 2]
    assert bm.num_free_gpu_blocks == 6 and bm.gpu_usage == 0.0
    assert bm.get_block_ids("nobody") == []
    bm.check_integrity()


def test_allocate_appends_from_the_front_of_the_free_queue() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=0, block_size=4)
    assert bm.allocate_slots("a", 5) == [0, 1]
    assert bm.allocate_slots("a", 8) == []  # still fits in two blocks
    assert bm.allocate_slots("b", 1) == [2]
    assert bm.allocate_slots("a", 9) == [3]
    assert bm.get_block_ids("a") == [0, 1, 3]
    assert bm.get_block_ids("b") == [2]
    assert bm.free_gpu_block_ids() == [4, 5]
    assert bm.gpu_usage == pytest.approx(4 / 6)
    assert bm.allocate_slots("a", 4) == []  # never shrinks
    assert bm.get_block_ids("a") == [0, 1, 3]
    bm.check_integrity()


def test_allocate_fails_without_changing_anything() -> None:
    bm = BlockManager(num_gpu_blocks=3, num_cpu_blocks=0, block_size=2)
    assert bm.allocate_slots("a", 3) == [0, 1]
    assert bm.allocate_slots("b", 5) is None
    assert bm.allocate_slots("a", 7) is None
    assert bm.get_block_ids("a") == [0, 1]
    assert bm.get_block_ids("b") == []
    assert bm.free_gpu_block_ids() == [2]
    assert bm.request_ids() == {"a"}
    bm.check_integrity()


def test_free_returns_blocks_tail_first_to_the_back() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=0, block_size=4)
    bm.allocate_slots("a", 12)  # [0, 1, 2]
    bm.allocate_slots("b", 4)  # [3]
    bm.free("a")
    assert bm.free_gpu_block_ids() == [4, 5, 2, 1, 0]
    assert bm.allocate_slots("c", 9) == [4, 5, 2]
    bm.free("a")  # unknown now: no-op
    bm.free("b")
    bm.free("c")
    assert bm.free_gpu_block_ids() == [1, 0, 3, 2, 5, 4]
    assert bm.request_ids() == set()
    bm.check_integrity()


def test_num_blocks_to_allocate() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=0, block_size=4)
    assert bm.num_blocks_to_allocate("a", 0) == 0
    assert bm.num_blocks_to_allocate("a", 9) == 3
    bm.allocate_slots("a", 5)
    assert bm.num_blocks_to_allocate("a", 9) == 1
    assert bm.num_blocks_to_allocate("a", 3) == 0


def test_swap_out_and_in_exact_moves_and_queues() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=4, block_size=4)
    bm.allocate_slots("a", 8)  # [0, 1]
    bm.allocate_slots("b", 12)  # [2, 3, 4]
    moves = bm.swap_out("b")
    assert moves == [BlockMove(2, 0), BlockMove(3, 1), BlockMove(4, 2)]
    assert bm.is_swapped("b") and bm.get_block_ids("b") == []
    assert bm.get_cpu_block_ids("b") == [0, 1, 2]
    assert bm.free_gpu_block_ids() == [5, 4, 3, 2]
    assert bm.free_cpu_block_ids() == [3]
    assert bm.cpu_usage == pytest.approx(3 / 4)
    bm.check_integrity()

    assert bm.allocate_slots("a", 13) == [5, 4]  # freed GPU blocks are reusable at once
    assert not bm.can_swap_in("b")  # needs 3, two free
    assert bm.swap_in("b") is None
    assert bm.get_cpu_block_ids("b") == [0, 1, 2]
    bm.free("a")  # a held [0, 1, 5, 4]: free queue [3, 2, 4, 5, 1, 0]
    assert bm.can_swap_in("b", num_tokens_total=12)
    assert bm.can_swap_in("b", num_tokens_total=13)  # one block more than it holds
    moves = bm.swap_in("b")
    assert moves == [BlockMove(0, 3), BlockMove(1, 2), BlockMove(2, 4)]
    assert bm.get_block_ids("b") == [3, 2, 4] and not bm.is_swapped("b")
    assert bm.free_cpu_block_ids() == [3, 2, 1, 0]
    assert bm.free_gpu_block_ids() == [5, 1, 0]
    assert bm.allocate_slots("b", 13) == [5]
    bm.check_integrity()


def test_swap_out_fails_when_cpu_pool_is_full() -> None:
    bm = BlockManager(num_gpu_blocks=4, num_cpu_blocks=1, block_size=2)
    bm.allocate_slots("a", 4)
    assert bm.swap_out("a") is None
    assert bm.get_block_ids("a") == [0, 1] and not bm.is_swapped("a")
    assert bm.free_cpu_block_ids() == [0]
    bm.check_integrity()


def test_swapped_request_cannot_allocate_and_free_releases_cpu_blocks() -> None:
    bm = BlockManager(num_gpu_blocks=4, num_cpu_blocks=4, block_size=2)
    bm.allocate_slots("a", 3)
    bm.swap_out("a")
    with pytest.raises(ValueError):
        bm.allocate_slots("a", 5)
    with pytest.raises(ValueError):
        bm.swap_out("a")
    bm.free("a")
    assert bm.free_cpu_block_ids() == [2, 3, 1, 0]
    assert not bm.is_swapped("a")
    with pytest.raises(ValueError):
        bm.swap_in("a")
    bm.check_integrity()


def test_fork_shares_blocks_and_frees_on_last_reference() -> None:
    bm = BlockManager(num_gpu_blocks=4, num_cpu_blocks=4, block_size=2)
    bm.allocate_slots("p", 4)  # [0, 1]
    bm.fork("p", "c")
    assert bm.get_block_ids("c") == [0, 1]
    assert bm.gpu.refcounts[:2] == [2, 2]
    bm.check_integrity()
    bm.free("p")
    assert bm.free_gpu_block_ids() == [2, 3]
    assert bm.gpu.refcounts[:2] == [1, 1]
    bm.free("c")
    assert bm.free_gpu_block_ids() == [2, 3, 1, 0]
    bm.allocate_slots("x", 2)
    with pytest.raises(ValueError):
        bm.fork("p", "x")  # the child already holds blocks
    bm.check_integrity()


def test_swapping_a_shared_request_copies_its_blocks_and_keeps_refcounts() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=4, block_size=2)
    bm.allocate_slots("p", 4)  # [0, 1]
    bm.fork("p", "c")
    assert bm.swap_out("c") == [BlockMove(0, 0), BlockMove(1, 1)]
    assert bm.get_block_ids("p") == [0, 1] and bm.gpu.refcounts[:2] == [1, 1]
    assert bm.free_gpu_block_ids() == [2, 3, 4, 5]  # still held by p
    bm.check_integrity()
    assert bm.swap_out("p") == [BlockMove(0, 2), BlockMove(1, 3)]  # a second, separate copy
    assert bm.free_gpu_block_ids() == [2, 3, 4, 5, 1, 0]
    bm.check_integrity()
    # Forking a swapped request shares its CPU blocks; swapping one in copies them again.
    bm.fork("c", "g")
    assert bm.get_cpu_block_ids("g") == [0, 1] and bm.cpu.refcounts == [2, 2, 1, 1]
    assert bm.swap_in("g") == [BlockMove(0, 2), BlockMove(1, 3)]
    assert bm.cpu.refcounts == [1, 1, 1, 1]
    bm.check_integrity()


def test_fork_of_unknown_parent_gives_an_empty_table() -> None:
    bm = BlockManager(num_gpu_blocks=2, num_cpu_blocks=0, block_size=2)
    bm.fork("nobody", "c")
    assert bm.get_block_ids("c") == [] and bm.request_ids() == {"c"}
    assert bm.allocate_slots("c", 1) == [0]
    bm.check_integrity()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda bm: bm.gpu.refcounts.__setitem__(3, -1), "< 0"),
        (lambda bm: bm.gpu.refcounts.__setitem__(0, 2), "refcount 2 but 1 tables"),
        (lambda bm: bm.gpu.free_queue.remove(3), "leaked"),
        (lambda bm: bm.gpu.refcounts.__setitem__(3, 1), "free with refcount"),
        (lambda bm: bm._gpu_tables["a"].append(0), "holds a block twice"),
        (lambda bm: bm._gpu_tables.__setitem__("z", [9]), "unknown blocks"),
        (lambda bm: bm.cpu.free_queue.remove(1), "cpu block 1"),
        (lambda bm: bm._cpu_tables.__setitem__("a", []), "both pools"),
        (lambda bm: bm._gpu_tables.__setitem__("z", [2]), "gpu block 2: refcount 1 but 2"),
    ],
)
def test_check_integrity_names_the_problem(
    corrupt: Callable[[BlockManager], object], message: str
) -> None:
    bm = BlockManager(num_gpu_blocks=4, num_cpu_blocks=2, block_size=2)
    bm.allocate_slots("a", 3)  # [0, 1]
    bm.allocate_slots("b", 1)  # [2]
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_integrity()


def test_unknown_block_in_the_free_queue_is_caught() -> None:
    bm = BlockManager(num_gpu_blocks=3, num_cpu_blocks=0, block_size=2)
    bm.gpu.free_queue._queue[7] = None
    with pytest.raises(AssertionError, match="unknown block in the free queue"):
        bm.check_integrity()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=0)
    with pytest.raises(ValueError):
        BlockManager(num_gpu_blocks=-1, num_cpu_blocks=0, block_size=4)
    assert BlockManager(num_gpu_blocks=0, num_cpu_blocks=0, block_size=4).gpu_usage == 0.0
