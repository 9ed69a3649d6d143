"""Chained block hashes for the prefix cache."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

# Distinct leading bytes keep a first block's encoding apart from any chained block's.
_ROOT = b"\x00"
_CHAINED = b"\x01"


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit xxh3 hash of a full block's token ids chained onto its parent block's hash.

    `parent_hash` is None for a sequence's first block. Equal prefixes give equal hashes
    (in any process); different ones almost surely differ, and the block manager confirms
    every hit by comparing tokens and prefix ids, so a collision costs a miss, never wrong KV.
    """
    head = _ROOT if parent_hash is None else _CHAINED + parent_hash.to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(head + array("q", token_ids).tobytes())


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int | None = None
) -> None:
    """Extend `hashes` in place to the chained hashes of the first `num_blocks` full blocks
    of `token_ids` (all of them by default).

    Invariant kept: `hashes[i]` is block i's hash chained onto `hashes[i - 1]`, over
    `token_ids[i * block_size:(i + 1) * block_size]`. Only the blocks not yet hashed are
    hashed, so a caller that keeps the list while the tokens grow hashes each block once.
    """
    full = len(token_ids) // block_size
    end = full if num_blocks is None else min(num_blocks, full)
    for start in range(len(hashes) * block_size, end * block_size, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
