"""One KV-cache block: its id, reference count and prefix-cache registration."""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: `cdiv(num_tokens, block_size)` blocks hold `num_tokens` tokens."""
    return -(-numerator // denominator)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Bookkeeping for one block of `block_size` KV slots; the KV itself lives in the engine.

    Invariants (kept by `BlockManager` and `FreeBlockQueue`):
    - `ref_count` is the number of sequences whose block table holds this block. A block with
      `ref_count == 0` is in the free queue exactly once; a block with `ref_count > 0` is not.
    - `block_hash`, `token_ids`, `prefix_id` and `parent_prefix_id` are either all set or all
      None. They are set only while the block is registered in the prefix cache, and then the
      block holds the KV of `token_ids` following the token prefix `parent_prefix_id` names.
    - `prefix_id` names the whole token prefix ending with this block. Ids are never reused,
      so a child registered under a parent that was since evicted can never be matched: the
      id it extends no longer belongs to any block.
    - `prev_free` / `next_free` are set exactly while the block is in the free queue.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    prefix_id: int | None = None
    parent_prefix_id: int | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def forget_hash(self) -> None:
        """Drop the prefix-cache registration (the caller removes the hash-table entry)."""
        self.block_hash = None
        self.token_ids = None
        self.prefix_id = None
        self.parent_prefix_id = None
