"""A KV-cache block: its bookkeeping, the free queue threaded through free blocks, and
the chained hash that names a full block's tokens in the prefix cache."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash


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


class FreeBlockQueue:
    """Free blocks in eviction order: the front is the block freed longest ago.

    A doubly linked list threaded through the blocks' own `prev_free` / `next_free` fields
    between two sentinel nodes, so `popleft`, `append` and `remove` (from anywhere, used to
    revive a cached block on a prefix hit) are all O(1); `deque.remove` would be O(n).

    Invariants: a block is in the queue exactly when its `prev_free` is set (the sentinels
    make that true for the first and last block too); no block is linked twice; `len(self)`
    is the number of linked blocks.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the front block; IndexError when empty."""
        if self._len == 0:
            raise IndexError("pop from an empty FreeBlockQueue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Link `block` at the back; ValueError if it is already queued."""
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is; ValueError if it is not queued."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


# Distinct leading bytes keep a first block's encoding apart from any chained block's.
_ROOT = b"\x00"
_CHAINED = b"\x01"


class BlockHashes(list[int]):
    """A sequence's chained block hashes, whose first block chains onto `root` rather than
    nothing: a LoRA adapter's, so that its blocks are its own (`lora_name` names it)."""

    def __init__(self, root: int | None = None, lora_name: str | None = None) -> None:
        super().__init__()
        self.root = root
        self.lora_name = lora_name


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

    Invariant kept: `hashes[i]` is block i's hash chained onto `hashes[i - 1]` (the first
    onto a `BlockHashes`'s root), over `token_ids[i * block_size:(i + 1) * block_size]`.
    Only the blocks not yet hashed are hashed, so a caller that keeps the list while the
    tokens grow hashes each block once.
    """
    full = len(token_ids) // block_size
    end = full if num_blocks is None else min(num_blocks, full)
    root = hashes.root if isinstance(hashes, BlockHashes) else None
    for start in range(len(hashes) * block_size, end * block_size, block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
