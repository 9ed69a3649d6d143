"""The free-block queue: FIFO with O(1) removal from the middle."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cache.block import KVCacheBlock


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
