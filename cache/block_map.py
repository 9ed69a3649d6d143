"""The block map: every KV-cache block's state, one character per block."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from cache.block import KVCacheBlock


class BlockState(enum.StrEnum):
    """What a block is doing now; the value is its character in a block map.

    Exactly one applies to each block: FREE and CACHED blocks have `ref_count == 0` (CACHED
    ones still hold a registered prefix, which a hit can revive until the block is taken
    for new use and the prefix evicted); USED blocks have `ref_count == 1`, SHARED ones
    `ref_count > 1` (full prefix blocks in several sequences' block tables).
    """

    FREE = "f"
    CACHED = "c"
    USED = "u"
    SHARED = "s"


def block_map(blocks: Iterable[KVCacheBlock]) -> str:
    """The states of `blocks` in order, one `BlockState` character each.

    O(len(blocks)): built as one list, then joined.
    """
    free, cached = BlockState.FREE.value, BlockState.CACHED.value
    used, shared = BlockState.USED.value, BlockState.SHARED.value
    return "".join(
        [
            (cached if block.block_hash is not None else free)
            if block.ref_count == 0
            else (used if block.ref_count == 1 else shared)
            for block in blocks
        ]
    )
