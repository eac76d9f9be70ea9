"""The paged prefill kernel against the slow reference, under the Triton interpreter on CPU.

Each batch mixes fresh prefills of lengths around a block boundary, chunks after a cached
prefix that ends mid-block, decode rows (one new token) and a context of a few hundred tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.paged_prefill import paged_prefill_attention, plan_prefill_tiles
from tests.kernel_refs import DEVICE, PagedBatch, huge_kv_pool, make_batch
from tests.test_kernels_decode import CASES, assert_close


def mixed_seqs(block_size: int) -> list[tuple[int, int]]:
    """(cached context, new tokens) per sequence."""
    bs = block_size
    return [
        (0, 1),  # a one-token prompt
        (0, bs - 1),
        (0, bs),
        (0, bs + 1),
        (bs - 1, bs + 2),  # a chunk after a prefix that ends one short of a block
        (bs, 1),  # decodes
        (2 * bs + 1, 1),
        (200, 90),  # a few hundred tokens, the chunk spanning several query tiles
    ]


def prefill_batch(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype, **kw: int
) -> PagedBatch:
    return make_batch(
        mixed_seqs(block_size),
        num_kv_heads=kw.pop("num_kv_heads", 2),
        queries_per_kv=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        **kw,
    )


def run(b: PagedBatch, **kw: object) -> torch.Tensor:
    return paged_prefill_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        b.scale,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("block_size", "head_dim", "group"), CASES)
def test_prefill_matches_reference_fp32(block_size: int, head_dim: int, group: int) -> None:
    b = prefill_batch(block_size, head_dim, group, torch.float32, seed=block_size * group)
    assert_close(run(b), b.reference(), torch.float32)


@pytest.mark.parametrize(
    ("dtype", "block_size"),
    [(torch.float16, 16), (torch.bfloat16, 16), (torch.bfloat16, 8), (torch.bfloat16, 128)],
)
def test_prefill_half_precision(dtype: torch.dtype, block_size: int) -> None:
    """Half precision at head size 128, where a GPU takes the wide tiles (prefill_config):
    blocks smaller than, equal to and as large as a key tile."""
    b = prefill_batch(block_size, 128, 4, dtype, seed=9)
    out = run(b)
    assert out.dtype == dtype
    assert_close(out, b.reference(), dtype)


def test_odd_head_dim_and_group_work() -> None:
    b = make_batch(
        [(5, 20), (0, 3), (40, 1)],
        num_kv_heads=2,
        queries_per_kv=3,
        head_dim=80,
        block_size=8,
        seed=1,
    )
    assert_close(run(b), b.reference(), torch.float32)


def test_tiles_can_leave_decode_rows_alone() -> None:
    """With min_query_len=2 (how the worker leaves decodes to the decode kernel) the rows of
    one-token sequences are not written; every other row is."""
    b = prefill_batch(16, 64, 4, torch.float32, seed=6)
    tiles = plan_prefill_tiles(b.query_lens_host, 4, DEVICE, min_query_len=2)
    sentinel = torch.full_like(b.q, 7.0)
    out = run(b, tiles=tiles, out=sentinel)
    want = b.reference()
    starts = b.query_start_loc.tolist()
    for s, n in enumerate(b.query_lens_host):
        rows = slice(starts[s], starts[s] + n)
        if n == 1:
            assert bool((out[rows] == 7.0).all())
        else:
            assert_close(out[rows], want[rows], torch.float32)


def test_prefix_cached_chunks_equal_one_prefill() -> None:
    """A prompt prefilled in chunks over its own cache gives the rows one whole prefill gives:
    what chunked prefill and a prefix-cache hit rely on."""
    whole = make_batch([(0, 70)], num_kv_heads=1, queries_per_kv=4, head_dim=64, block_size=16)
    full = run(whole)
    starts = [0, 16, 33, 69]  # chunk boundaries on, before and after block edges
    for a, z in zip(starts, starts[1:] + [70], strict=True):
        chunk = PagedBatch(
            q=whole.q[a:z],
            k_cache=whole.k_cache,
            v_cache=whole.v_cache,
            block_tables=whole.block_tables,
            query_start_loc=torch.tensor([0, z - a], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([z], dtype=torch.int32, device=DEVICE),
            query_lens_host=[z - a],
            seq_lens_host=[z],
            scale=whole.scale,
        )
        torch.testing.assert_close(run(chunk), full[a:z], atol=1e-6, rtol=1e-6)


def test_block_offset_beyond_32_bits() -> None:
    k_cache, v_cache, big = huge_kv_pool(16, 1, 64, torch.float16)
    b = make_batch(
        [(10, 25)],
        num_kv_heads=1,
        queries_per_kv=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    tables = torch.tensor([[big + 3, 7, big + 2]], dtype=torch.int32, device=DEVICE)
    for j, blk in enumerate(tables[0].tolist()):
        k_cache[blk] = b.k_cache[int(b.block_tables[0, j])]
        v_cache[blk] = b.v_cache[int(b.block_tables[0, j])]
    k_cache[2:4] = 0  # where wrapped 32-bit offsets would land
    v_cache[2:4] = 0
    huge = dataclasses.replace(b, k_cache=k_cache, v_cache=v_cache, block_tables=tables)
    assert_close(run(huge), b.reference(), torch.float16)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("query_start_loc", torch.zeros(3, dtype=torch.int32), "num_seqs \\+ 1"),
        ("seq_lens", torch.zeros(8, dtype=torch.int64), "seq_lens"),
        ("k_cache", torch.zeros(4, 16, 2, 24), "head_dim 24"),
        ("q", torch.zeros(4, 8, 64, dtype=torch.float16), "match the cache"),
    ],
)
def test_outside_the_envelope_is_refused(field: str, value: torch.Tensor, message: str) -> None:
    b = prefill_batch(16, 64, 4, torch.float32)
    setattr(b, field, value.to(DEVICE))
    with pytest.raises(ValueError, match=message):
        run(b)


def test_prefill_config_by_device_dtype_and_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide tiles only where they were measured to pay and to fit (Hopper, 16-bit caches,
    head dims up to 128); Triton's defaults everywhere else."""
    from kernels import paged_prefill as pp

    default = pp.PrefillConfig(pp.BLOCK_M, 32, 4, 3)
    cuda = torch.device("cuda")
    capability = {"cap": (9, 0)}
    monkeypatch.setattr(pp, "_compute_capability", lambda device: capability["cap"])
    assert pp.prefill_config(cuda, torch.bfloat16, 128, 16) == pp.PrefillConfig(128, 128, 8, 2)
    assert pp.prefill_config(cuda, torch.float16, 64, 16) == pp.PrefillConfig(128, 128, 8, 2)
    assert pp.prefill_config(cuda, torch.float32, 128, 16) == default
    assert pp.prefill_config(cuda, torch.bfloat16, 256, 16) == default
    assert pp.prefill_config(torch.device("cpu"), torch.bfloat16, 128, 16) == default
    for other in ((8, 0), (12, 0)):  # Ampere; a GPU with ~100 KiB of shared memory a block
        capability["cap"] = other
        assert pp.prefill_config(cuda, torch.bfloat16, 128, 16) == default
    assert pp.prefill_config(cuda, torch.bfloat16, 128, 64).tile == 64

    # Tiles carry the config's rows; tiles planned for other rows are refused.
    tiles = pp.plan_prefill_tiles([300, 1, 40], 4, "cpu", min_query_len=2, block_m=128)
    assert tiles.block_q == 32 and tiles.seq.tolist() == [0] * 10 + [2, 2]
    b = make_batch([(0, 40)], num_kv_heads=1, queries_per_kv=4, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="tiles were planned"):
        run(b, tiles=tiles)
