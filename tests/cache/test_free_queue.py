"""FreeBlockQueue: FIFO order, O(1) removal from anywhere, loud misuse."""

from __future__ import annotations

import pytest

from cache import FreeBlockQueue, KVCacheBlock


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_starts_with_blocks_in_order_and_pops_fifo() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 4 and _ids(queue) == [0, 1, 2, 3]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert _ids(queue) == [1, 2, 3, 0]
    assert [queue.popleft().block_id for _ in range(4)] == [1, 2, 3, 0]
    assert len(queue) == 0


@pytest.mark.parametrize("position", [0, 2, 4])
def test_remove_front_middle_back(position: int) -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[position])
    assert _ids(queue) == [i for i in range(5) if i != position]
    assert blocks[position].prev_free is None and blocks[position].next_free is None
    queue.append(blocks[position])
    assert _ids(queue)[-1] == position and len(queue) == 5


def test_misuse_raises() -> None:
    block = KVCacheBlock(block_id=0)
    queue = FreeBlockQueue()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)
    queue.append(block)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(block)
    assert len(queue) == 1
