"""Chained block hashes, and prefix caching and copy-on-write in the block manager: exact
block ids, free-queue order, refcounts, events and counters."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest

import control_plane.block_hash as block_hash
from control_plane.block_hash import hash_block, request_block_hashes, token_bytes
from control_plane.block_manager import (
    AllBlocksCleared,
    BlockManager,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CachedBlock,
    PrefixCacheStats,
    SlotReservation,
)
from control_plane.request import Request
from pagedserve.plan import BlockMove
from pagedserve.sampling_params import SamplingParams

BS = 4

# -- hashes ---------------------------------------------------------------------------------------


def test_hash_is_pinned_and_stable_across_processes() -> None:
    """The index in Redis outlives processes: the encoding and seed must never drift."""
    h = hash_block(None, [1, 2, 3, 4], ("salt",)).hex()
    code = (
        "from control_plane.block_hash import hash_block;"
        "print(hash_block(None, [1, 2, 3, 4], ('salt',)).hex())"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
        )
        assert out.stdout.strip() == h
    assert h == "f217b8fc70d5ff40b326cf21c71ec829"
    assert len(hash_block(None, [])) == 16


def test_hash_depends_on_every_input_unambiguously() -> None:
    base = hash_block(None, [1, 2])
    parent = hash_block(None, [9])
    variants = [
        hash_block(parent, [1, 2]),
        hash_block(None, [2, 1]),
        hash_block(None, [1, 2, 0]),
        hash_block(None, [1 + (2 << 32)]),  # fixed width: not the same bytes as [1, 2]
        hash_block(None, [1, 2], ("",)),
        hash_block(None, [1, 2], ("ab", "c")),
        hash_block(None, [1, 2], ("a", "bc")),  # length-prefixed keys
        hash_block(None, [1, 2], (b"ab", "c")),
        hash_block(None, [1, 2], (7,)),
        hash_block(None, [1, 2], ("7",)),
        hash_block(None, [1, 2], (-1,)),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    with pytest.raises(TypeError):
        hash_block(None, [1], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hash_block(None, [1], (True,))


def test_request_block_hashes_chain_and_skip_the_partial_block() -> None:
    tokens = list(range(11))
    hashes = request_block_hashes(tokens, BS)
    assert hashes == [
        hash_block(None, [0, 1, 2, 3]),
        hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7]),
    ]
    assert request_block_hashes(tokens[4:], BS, parent=hashes[0]) == hashes[1:]
    salted = request_block_hashes(tokens, BS, cache_salt="s")
    assert salted[1] == hash_block(salted[0], [4, 5, 6, 7], ("s",))
    assert not set(salted) & set(hashes)
    assert request_block_hashes([1, 2, 3], BS) == []
    with pytest.raises(ValueError):
        request_block_hashes(tokens, 0)


def test_request_extends_its_hashes_as_output_fills_blocks() -> None:
    req = Request("r", list(range(6)), SamplingParams(), cache_salt="s")
    req.extend_block_hashes(BS)
    assert req.block_hashes == request_block_hashes(range(6), BS, "s")  # type: ignore[arg-type]
    req.output_token_ids += [6, 7, 8]
    req.extend_block_hashes(BS)
    assert req.block_hashes == request_block_hashes(list(range(9)), BS, "s")
    assert req.token_ids_slice(4, 8) == [4, 5, 6, 7] and req.token_ids_slice(7, 9) == [7, 8]


# -- helpers ----------------------------------------------------------------------------------


def req(req_id: str, tokens: Sequence[int], salt: str | None = None) -> Request:
    return Request(req_id, list(tokens), SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, r: Request, compute: bool = True) -> tuple[tuple[int, ...], list[int]]:
    """Look up, allocate the whole request, and (optionally) compute and cache it, as the
    scheduler does; returns (hit block ids, new block ids)."""
    hit = bm.find_cached_prefix(r)
    new = bm.allocate_slots(r.req_id, r.num_tokens, prefix=hit)
    assert new is not None
    r.num_computed_tokens = hit.num_tokens
    if compute:
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    bm.check_integrity()
    return hit.block_ids, new


def h(tokens: Sequence[int], salt: str | None = None) -> list[bytes]:
    return request_block_hashes(list(tokens), BS, salt)


# -- hits, misses, eviction -------------------------------------------------------------------


def test_hit_and_miss_with_a_prompt_ending_mid_block() -> None:
    bm = BlockManager(num_gpu_blocks=10, num_cpu_blocks=0, block_size=BS)
    a = req("a", range(10))  # two full blocks + 2 tokens
    assert admit(bm, a) == ((), [0, 1, 2])
    ha = h(range(10))
    assert bm.drain_events() == [BlockStored(ha[0], None), BlockStored(ha[1], ha[0])]
    assert bm.cached_prefix_hashes() == ha

    b = req("b", [*range(8), 50, 51, 52])  # shares a's two full blocks
    hit = bm.find_cached_prefix(b)
    assert (hit.block_ids, hit.num_tokens, hit.num_query_tokens) == ((0, 1), 8, 11)
    assert bm.allocate_slots("b", 11, prefix=hit) == [3]
    assert bm.get_block_ids("b") == [0, 1, 3]
    assert bm.gpu.refcounts[:4] == [2, 2, 1, 1]

    c = req("c", [*range(4), 99, 5, 6, 7, 8])  # diverges in block 1
    assert admit(bm, c, compute=False) == ((0,), [4, 5])
    d = req("d", [7, 1, 2, 3, 4])  # diverges at the first token
    assert admit(bm, d, compute=False) == ((), [6, 7])
    assert bm.prefix_cache_stats() == PrefixCacheStats(
        num_queries=4,
        num_hits=2,
        num_query_tokens=10 + 11 + 9 + 5,
        num_hit_tokens=8 + 4,
        num_cached_blocks=2,
    )
    assert bm.prefix_cache_stats().hit_rate == pytest.approx(12 / 35)


def test_a_block_aligned_prompt_recomputes_its_last_block() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=0, block_size=BS)
    admit(bm, req("a", range(8)))  # [0, 1], both cached
    b = req("b", range(8))
    hit = bm.find_cached_prefix(b)
    assert hit.block_ids == (0,) and hit.num_tokens == 4  # 7 tokens at most, whole blocks
    assert bm.allocate_slots("b", 8, prefix=hit) == [2]
    b.num_computed_tokens = 8
    bm.cache_full_blocks(b)  # block 2 holds block 1's content: the hash stays with block 1
    assert bm.gpu.cached == {h(range(8))[0]: 0, h(range(8))[1]: 1}
    one = req("one", [0])
    assert bm.find_cached_prefix(one).block_ids == ()
    bm.check_integrity()


def test_freed_blocks_stay_findable_until_reallocated_tail_first() -> None:
    bm = BlockManager(num_gpu_blocks=6, num_cpu_blocks=0, block_size=BS)
    admit(bm, req("a", range(13)))  # [0, 1, 2, 3]; blocks 0..2 cached
    ha = h(range(13))
    bm.drain_events()
    bm.free("a")
    assert bm.free_gpu_block_ids() == [4, 5, 3, 2, 1, 0]
    assert bm.gpu.refcounts == [0] * 6 and bm.num_free_gpu_blocks == 6
    assert bm.cached_prefix_hashes() == ha

    # Uncached blocks go first; then the tail block of a's prompt is evicted before its head.
    assert bm.allocate_slots("x", 12) == [4, 5, 3]
    assert bm.drain_events() == []
    assert bm.allocate_slots("y", 4) == [2]
    assert bm.drain_events() == [BlockRemoved(ha[2])]
    assert bm.cached_prefix_hashes() == ha[:2]

    # A hit takes cached free blocks out of the middle of the free queue.
    bm.free("x")  # free queue [1, 0, 3, 5, 4]
    assert admit(bm, req("b", range(13)), compute=False) == ((0, 1), [3, 5])
    assert bm.free_gpu_block_ids() == [4]


def test_a_hit_reclaims_free_cached_blocks_and_counts_them_against_the_pool() -> None:
    bm = BlockManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=BS)
    admit(bm, req("a", range(8)))  # [0, 1]
    bm.free("a")  # free queue [2, 3, 1, 0]
    b = req("b", [*range(4), 9, 9, 9, 9, 9, 9, 9, 9, 9])  # hit [0], needs 3 more blocks
    hit = bm.find_cached_prefix(b)
    assert hit.block_ids == (0,)
    assert bm.allocate_slots("b", 13, prefix=hit) == [2, 3, 1]
    assert bm.drain_events()[-1] == BlockRemoved(h(range(8))[1])
    bm.free("b")
    c = req("c", [*range(4), *[8] * 13])  # hit [0] + 4 more: the pool has 3 others
    hit = bm.find_cached_prefix(c)
    assert hit.block_ids == (0,)
    assert bm.allocate_slots("c", 17, prefix=hit) is None
    assert bm.free_gpu_block_ids() == [1, 3, 2, 0] and bm.request_ids() == set()
    bm.allocate_slots("x", 1)
    with pytest.raises(ValueError, match="a prefix starts a table"):
        bm.allocate_slots("x", 5, prefix=hit)
    bm.check_integrity()


def test_a_hash_collision_is_ruled_out_by_the_stored_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def colliding(parent: bytes | None, token_ids: Sequence[int], extra: tuple = ()) -> bytes:
        return (parent or b"") + b"x"  # depends on the position only

    monkeypatch.setattr(block_hash, "hash_block", colliding)
    bm = BlockManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=BS)
    admit(bm, req("a", range(9)))  # [0, 1, 2], hashes b"x", b"xx"
    assert bm.cached_prefix_hashes() == [b"x", b"xx"]
    b = req("b", [*range(4), 7, 7, 7, 7, 7])
    assert b.block_hashes == [] and bm.find_cached_prefix(b).block_ids == (0,)
    assert b.block_hashes == [b"x", b"xx"]  # same hash for block 1, other tokens
    assert admit(bm, b) == ((0,), [3, 4])
    assert bm.gpu.cached == {b"x": 0, b"xx": 1}  # b's block 1 is not registered over a's
    c = req("c", [9, 9, 9, 9, 9])  # collides with a's first block
    assert admit(bm, c, compute=False) == ((), [5, 6])


def test_cache_salt_isolates_requests() -> None:
    bm = BlockManager(num_gpu_blocks=12, num_cpu_blocks=0, block_size=BS)
    admit(bm, req("a", range(9), salt="tenant-1"))  # [0, 1, 2]
    assert bm.find_cached_prefix(req("b", range(9))).block_ids == ()
    assert bm.find_cached_prefix(req("c", range(9), salt="tenant-2")).block_ids == ()
    assert bm.find_cached_prefix(req("d", range(9), salt="tenant-1")).block_ids == (0, 1)
    admit(bm, req("e", range(9)))  # unsalted: its own blocks [3, 4, 5]
    assert bm.find_cached_prefix(req("f", range(9))).block_ids == (3, 4)


def test_disabled_caching_never_hits_nor_records() -> None:
    bm = BlockManager(
        num_gpu_blocks=6, num_cpu_blocks=0, block_size=BS, enable_prefix_caching=False
    )
    admit(bm, req("a", range(9)))
    assert admit(bm, req("b", range(9))) == ((), [3, 4, 5])
    assert bm.cached_prefix_hashes() == [] and bm.drain_events() == []
    assert bm.prefix_cache_stats() == PrefixCacheStats()


def test_events_overflow_into_a_restatement() -> None:
    bm = BlockManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=1, max_pending_events=3)
    admit(bm, req("a", [0, 1, 2]))  # [0, 1, 2], all cached: three events, the limit
    admit(bm, req("b", [5, 6, 7, 8]))  # [3, 4, 5, 6]: more than the limit
    ha, hb = request_block_hashes([0, 1, 2], 1), request_block_hashes([5, 6, 7, 8], 1)
    assert bm.cached_prefix_hashes() == ha + hb
    restated = [BlockStored(x, ([None] + ha)[i]) for i, x in enumerate(ha)]
    restated += [BlockStored(x, ([None] + hb)[i]) for i, x in enumerate(hb)]
    assert bm.drain_events() == [AllBlocksCleared(), *restated]
    assert bm.drain_events() == []
    bm.free("a")  # free queue [7, 2, 1, 0]
    assert bm.allocate_slots("c", 2) == [7, 2]
    assert bm.drain_events() == [BlockRemoved(ha[2])]


# -- swapping keeps the cache consistent ------------------------------------------------------


def test_swap_in_offers_the_new_blocks_to_the_cache_again() -> None:
    bm = BlockManager(num_gpu_blocks=7, num_cpu_blocks=4, block_size=BS)
    a = req("a", range(9))
    admit(bm, a)  # [0, 1, 2]; 0 and 1 cached
    assert bm.swap_out("a") == [BlockMove(0, 0), BlockMove(1, 1), BlockMove(2, 2)]
    assert bm.cached_prefix_hashes() == h(range(9))  # still findable in the free queue
    assert bm.swap_in("a") == [BlockMove(0, 3), BlockMove(1, 4), BlockMove(2, 5)]
    a.output_token_ids += [10, 11, 12]
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)  # 3 and 4 duplicate cached blocks 0 and 1; block 5 is new
    ha = h(a.all_token_ids)
    assert bm.gpu.cached == {ha[0]: 0, ha[1]: 1, ha[2]: 5}
    bm.check_integrity()


# -- copy-on-write and forks ------------------------------------------------------------------


def test_copy_on_write_once_per_divergent_writer_and_in_place_for_the_last_holder() -> None:
    bm = BlockManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=BS)
    bm.allocate_slots("p", 6)  # [0, 1]: block 1 half full
    for child in ("c1", "c2"):
        bm.fork("p", child)
    assert bm.gpu.refcounts[:2] == [3, 3]

    assert bm.reserve_slots("c1", 6, 6) == SlotReservation()  # no write, no copy
    first = bm.reserve_slots("c1", 6, 7)
    assert first is not None
    assert (first.copies, first.new_block_ids) == ([BlockMove(1, 2)], [])
    assert bm.get_block_ids("c1") == [0, 2] and bm.gpu.refcounts[:3] == [3, 2, 1]
    again = bm.reserve_slots("c1", 7, 9)  # its own block now, plus one more
    assert again is not None and (again.copies, again.new_block_ids) == ([], [3])

    second = bm.reserve_slots("c2", 6, 10)  # copies first, then appended blocks
    assert second is not None
    assert (second.copies, second.new_block_ids) == ([BlockMove(1, 4)], [5])
    last = bm.reserve_slots("p", 6, 7)  # the last holder writes in place
    assert last is not None and (last.copies, last.new_block_ids) == ([], [])
    assert bm.get_block_ids("p") == [0, 1] and bm.gpu.refcounts[:2] == [3, 1]
    bm.check_integrity()


def test_copy_on_write_fails_without_changing_anything() -> None:
    bm = BlockManager(num_gpu_blocks=3, num_cpu_blocks=0, block_size=BS)
    bm.allocate_slots("p", 6)  # [0, 1]
    bm.fork("p", "c")
    assert bm.reserve_slots("c", 6, 9) is None  # a copy and a new block, one free
    assert bm.get_block_ids("c") == [0, 1] and bm.gpu.refcounts == [2, 2, 0]
    slots = bm.reserve_slots("c", 8, 9)  # a write past the shared blocks copies nothing
    assert slots is not None and (slots.copies, slots.new_block_ids) == ([], [2])
    bm.check_integrity()


def test_refcounts_after_an_n4_fork_and_as_each_child_finishes() -> None:
    bm = BlockManager(num_gpu_blocks=12, num_cpu_blocks=0, block_size=BS)
    parent = req("p", range(10))  # computes 9 tokens: [0, 1, 2], blocks 0 and 1 full
    hit = bm.find_cached_prefix(parent)
    bm.allocate_slots("p", 9, prefix=hit)
    parent.num_computed_tokens = 9
    bm.cache_full_blocks(parent)
    children = [f"p#{i}" for i in range(4)]
    for c in children:
        bm.fork("p", c)
    bm.free("p")
    assert bm.gpu.refcounts[:3] == [4, 4, 4]
    assert bm.num_gpu_block_refs == 12 and bm.num_free_gpu_blocks == 9
    copies = []
    for c in children:  # each computes the last prompt token: all but the last copy block 2
        slots = bm.reserve_slots(c, 9, 10)
        assert slots is not None
        copies += slots.copies
    assert copies == [BlockMove(2, 3), BlockMove(2, 4), BlockMove(2, 5)]
    assert [bm.get_block_ids(c) for c in children] == [[0, 1, 3], [0, 1, 4], [0, 1, 5], [0, 1, 2]]
    assert bm.gpu.refcounts[:6] == [4, 4, 1, 1, 1, 1]
    bm.check_integrity()
    expected = [[3, 3, 1, 0, 1, 1], [2, 2, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    for c, refs in zip(children, expected, strict=True):
        bm.free(c)
        assert bm.gpu.refcounts[:6] == refs
        bm.check_integrity()
    assert bm.free_gpu_block_ids() == [6, 7, 8, 9, 10, 11, 3, 4, 5, 2, 1, 0]
    assert bm.cached_prefix_hashes() == h(range(8))


def _cache_in(pool: BlockPool, block_id: int) -> None:
    pool.cached[b"z"] = block_id
    pool.meta[block_id] = CachedBlock(b"z", None, token_bytes([1, 2, 3, 4]))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda bm: bm.gpu.cached.__setitem__(b"z" * 16, 3), "hash maps differ"),
        (lambda bm: bm.gpu.cached.__setitem__(next(iter(bm.gpu.cached)), 7), "disagree"),
        (lambda bm: bm.gpu.cached.update({b"z": 9}) or bm.gpu.meta.update({9: None}), "unknown"),
        (lambda bm: _cache_in(bm.cpu, 0), "CPU pool"),
        (lambda bm: bm._num_offered.__setitem__("ghost", 0), "offered"),
    ],
)
def test_check_integrity_covers_the_prefix_cache(corrupt: object, message: str) -> None:
    bm = BlockManager(num_gpu_blocks=8, num_cpu_blocks=2, block_size=BS)
    admit(bm, req("a", range(9)))
    corrupt(bm)  # type: ignore[operator]
    with pytest.raises(AssertionError, match=message):
        bm.check_integrity()
