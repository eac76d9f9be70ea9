"""Chained content hashes of full KV blocks, the keys of prefix caching and of the prefix index.

    block i's hash = H(block i-1's hash, block i's token ids, extra keys)

so a hash names a block's tokens *and* every token before it: two requests share block i's hash
exactly when they agree on all tokens up to the end of block i (and on the extra keys, e.g. a
per-request cache salt). Only full blocks are hashed.

The hash is xxh3-128 with a fixed seed over a canonical byte encoding (fixed-width
little-endian integers, length-prefixed fields), never Python's `hash()`: the same prompt
hashes the same in every process and after restarts, which the cluster-wide prefix index relies
on. Token ids must lie in [0, 2**64).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes
ExtraKey = str | bytes | int

_SEED = 0x70616765_64736276  # fixed forever: changing it invalidates every stored hash
_DOMAIN = b"pagedserve/block/v1"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
) -> BlockHash:
    """The 16-byte hash of one block given its parent block's hash (None for the first block)."""
    parts = [_DOMAIN]
    if parent is None:
        parts.append(b"\x00")
    else:
        parts += [b"\x01", _u32(len(parent)), parent]
    parts += [_u32(len(token_ids)), token_bytes(token_ids)]
    parts.append(_u32(len(extra_keys)))
    for key in extra_keys:
        parts += _encode_key(key)
    return xxhash.xxh3_128_digest(b"".join(parts), seed=_SEED)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the hash encodes them (8 bytes each, little-endian): also how a cached
    block keeps its tokens, a fifth of the memory of a tuple of Python ints."""
    return struct.pack(f"<{len(token_ids)}Q", *token_ids)


def block_extra_keys(cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra keys of every block of a request: its cache salt, when it has one."""
    return () if cache_salt is None else (cache_salt,)


def request_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, chained from `parent` (None: a sequence start).

    A trailing partial block is not hashed. Continuing a sequence with its last full block's
    hash as `parent` gives the same hashes as hashing the whole sequence at once.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    extra = block_extra_keys(cache_salt)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _encode_key(key: ExtraKey) -> list[bytes]:
    if isinstance(key, bool) or not isinstance(key, str | bytes | int):
        raise TypeError(f"extra keys must be str, bytes or int, got {type(key).__name__}")
    if isinstance(key, str):
        tag, data = b"s", key.encode()
    elif isinstance(key, bytes):
        tag, data = b"b", key
    else:
        tag, data = b"i", key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
    return [tag, _u32(len(data)), data]
