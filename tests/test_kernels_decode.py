"""Paged decode kernels (one-pass and split-K) against the slow reference, under the Triton
interpreter on CPU.

One batch holds every interesting context length at once (1, a block boundary -1/0/+1, a few
hundred), so each parametrized case is one launch. Block size x head dim is covered in full,
GQA ratios rotate through it rather than multiplying it.
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode_attention
from kernels.paged_decode_splitk import paged_decode_attention_splitk, use_split_k
from tests.kernel_refs import DEVICE, PagedBatch, huge_kv_pool, make_batch

# (atol, rtol) against a float64 reference; outputs are O(1). Worst absolute errors measured
# over CASES: fp32 4e-7, fp16 7e-4, bf16 1.1e-2. fp32 dots run in IEEE fp32 (never tf32), so
# fp32 is tight. fp16/bf16: the kernel rounds the softmax weights to the cache dtype before
# P @ V, as every fused kernel does, and rounds its output once (the interpreter's fp32 -> bf16
# cast truncates: up to one more bf16 ulp).
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 1.5e-2),
}

CASES = [  # (block_size, head_dim, queries_per_kv)
    (8, 64, 1),
    (8, 128, 4),
    (16, 64, 8),
    (16, 128, 1),
    (32, 64, 4),
    (32, 128, 8),
]


def context_lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 300]


def decode_batch(
    block_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    lens: list[int] | None = None,
    **kw: int,
) -> PagedBatch:
    lens = lens or context_lengths(block_size)
    seqs = [(n - 1, 1) for n in lens]  # one new token after n - 1 cached ones
    return make_batch(
        seqs,
        num_kv_heads=kw.pop("num_kv_heads", 2),
        queries_per_kv=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        **kw,
    )


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("block_size", "head_dim", "group"), CASES)
def test_decode_matches_reference_fp32(block_size: int, head_dim: int, group: int) -> None:
    b = decode_batch(block_size, head_dim, group, torch.float32, seed=block_size + group)
    out = paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    assert_close(out, b.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "head_dim", "group"), [CASES[1], CASES[4]])
def test_decode_half_precision(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    b = decode_batch(block_size, head_dim, group, dtype, seed=3)
    out = paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    assert out.dtype == dtype
    assert_close(out, b.reference(), dtype)


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group", "partition_size"),
    [(8, 64, 4, 32), (16, 128, 8, 64), (32, 64, 1, 64)],
)
def test_split_k_equals_one_pass(
    block_size: int, head_dim: int, group: int, partition_size: int
) -> None:
    # Lengths straddle partition boundaries: one partition, exactly one, one key into the next.
    p = partition_size
    lens = [1, p - 1, p, p + 1, 3 * p + 5, 300]
    b = decode_batch(block_size, head_dim, group, torch.float32, lens=lens, seed=11)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    one_pass = paged_decode_attention(*args)
    split = paged_decode_attention_splitk(
        *args, max_seq_len=max(lens), partition_size=partition_size
    )
    torch.testing.assert_close(split, one_pass, atol=1e-6, rtol=1e-6)
    assert_close(split, b.reference(), torch.float32)


def test_split_k_bf16_and_unknown_max_len() -> None:
    b = decode_batch(16, 64, 4, torch.bfloat16, lens=[5, 200], seed=5)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    split = paged_decode_attention_splitk(*args, partition_size=64)  # max_seq_len read back
    assert_close(split, b.reference(), torch.bfloat16)


def test_split_k_heuristic() -> None:
    # Few sequences with long contexts split; many sequences or short contexts do not.
    assert use_split_k(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132)
    assert not use_split_k(num_seqs=64, num_kv_heads=8, max_seq_len=32768, num_sms=132)
    assert not use_split_k(num_seqs=1, num_kv_heads=8, max_seq_len=512, num_sms=132)
    assert not use_split_k(num_seqs=1, num_kv_heads=1, max_seq_len=1 << 20, num_sms=0)


def test_odd_head_dim_and_group_work() -> None:
    # head_dim 80 pads to 128 and masks; 3 query heads per kv head pad to 4 (16 for tl.dot).
    b = decode_batch(16, 80, 3, torch.float32, lens=[1, 17, 40], seed=2)
    out = paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    assert_close(out, b.reference(), torch.float32)


def test_strided_inputs() -> None:
    # The worker's caches are views kv[layer, 0 | 1] of one pool; q may be a slice of a fused
    # qkv projection. Both have non-trivial strides outside the last axis.
    b = decode_batch(16, 64, 4, torch.float32, lens=[3, 33], seed=4)
    pool = torch.stack([b.k_cache, b.v_cache], dim=1)  # [num_blocks, 2, ...]
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    fused = torch.cat([b.q, torch.zeros_like(b.q)], dim=1)
    q = fused[:, : b.q.shape[1]]
    assert not q.is_contiguous() and not k_cache.is_contiguous()
    out = paged_decode_attention(q, k_cache, v_cache, b.block_tables, b.seq_lens, b.scale)
    assert_close(out, b.reference(), torch.float32)


def test_block_offset_beyond_32_bits() -> None:
    """Block ids whose element offset (block_id * stride_block) passes 2^32: the kernels must
    address them in 64 bits (see huge_kv_pool)."""
    k_cache, v_cache, big = huge_kv_pool(16, 1, 64, torch.float16)
    b = decode_batch(16, 64, 4, torch.float16, lens=[40], num_kv_heads=1)
    tables = torch.tensor([[big + 2, 5, big + 3]], dtype=torch.int32, device=DEVICE)
    assert (big + 3) * k_cache.stride(0) > 2**32
    for j, blk in enumerate(tables[0].tolist()):
        k_cache[blk] = b.k_cache[int(b.block_tables[0, j])]
        v_cache[blk] = b.v_cache[int(b.block_tables[0, j])]
    # Where a wrapped 32-bit offset would land instead (block big + i wraps to block i).
    k_cache[2:4] = 0
    v_cache[2:4] = 0
    args = (b.q, k_cache, v_cache, tables, b.seq_lens, b.scale)
    want = b.reference()
    assert_close(paged_decode_attention(*args), want, torch.float16)
    split = paged_decode_attention_splitk(*args, max_seq_len=40, partition_size=32)
    assert_close(split, want, torch.float16)


def _args(**over: object) -> dict[str, object]:
    b = decode_batch(16, 64, 2, torch.float32, lens=[5, 9])
    args: dict[str, object] = {
        "q": b.q,
        "k_cache": b.k_cache,
        "v_cache": b.v_cache,
        "block_tables": b.block_tables,
        "seq_lens": b.seq_lens,
        "scale": b.scale,
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"k_cache": torch.zeros(4, 16, 2, 8), "v_cache": torch.zeros(4, 16, 2, 8)}, "head_dim 8"),
        ({"k_cache": torch.zeros(4, 16, 2, 72), "v_cache": torch.zeros(4, 16, 2, 72)}, "72"),
        ({"k_cache": torch.zeros(4, 16, 2, 512), "v_cache": torch.zeros(4, 16, 2, 512)}, "512"),
        ({"k_cache": torch.zeros(4, 4, 2, 64), "v_cache": torch.zeros(4, 4, 2, 64)}, "block_size"),
        ({"k_cache": torch.zeros(4, 12, 2, 64), "v_cache": torch.zeros(4, 12, 2, 64)}, "12"),
        ({"q": torch.zeros(2, 4, 64, dtype=torch.float64)}, "match the cache"),
        (
            {
                "k_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float64),
                "v_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float64),
            },
            "dtype",
        ),
        ({"q": torch.zeros(2, 3, 64)}, "multiple of num_kv_heads"),
        ({"q": torch.zeros(2, 128, 64)}, "at most 32"),
        ({"block_tables": torch.zeros(2, 1, dtype=torch.int64)}, "block_tables"),
        ({"seq_lens": torch.ones(3, dtype=torch.int32)}, "one row per sequence"),
        ({"q": torch.zeros(2, 64, 4).transpose(1, 2)}, "contiguous last axis"),
        ({"v_cache": torch.zeros(4, 16, 1, 64)}, "match k_cache"),
    ],
)
def test_outside_the_envelope_is_refused(over: dict[str, object], message: str) -> None:
    for fn in (paged_decode_attention, paged_decode_attention_splitk):
        with pytest.raises(ValueError, match=message):
            fn(**_args(**over))  # type: ignore[arg-type]


def test_split_k_partition_must_be_whole_tiles() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        paged_decode_attention_splitk(**_args(), partition_size=48)  # type: ignore[arg-type]
