"""Recurrent-state slots: live slots, checkpoints that become visible a step after they
are written, least-recently-used eviction that never takes a slot the step reads or
writes, and the block manager's prefix hits held to the last checkpointed block."""

from __future__ import annotations

import pytest

from cache import AllocStatus, BlockManager, StatePool, extend_block_hashes


def test_live_slots_are_taken_and_released() -> None:
    pool = StatePool(2)
    first, second = pool.take("a"), pool.take("b")
    assert {first, second} == {0, 1} and pool.num_available == 0
    with pytest.raises(RuntimeError, match="num_available"):
        pool.take("c")
    pool.release("a")
    assert pool.take("c") == first
    pool.release("unknown")  # ignored


def test_a_checkpoint_is_found_only_after_the_step_that_writes_it() -> None:
    pool = StatePool(3)
    slot = pool.add_checkpoint(7)
    assert slot is not None
    assert not pool.has_checkpoint(7) and pool.resume(7) is None
    assert pool.add_checkpoint(7) is None  # one per prefix
    pool.next_step()
    assert pool.has_checkpoint(7) and pool.resume(7) == slot


def test_checkpoints_are_evicted_least_recently_used_and_never_while_busy() -> None:
    pool = StatePool(3)
    for prefix in (1, 2, 3):
        pool.add_checkpoint(prefix)
    # All three are written this step: nothing can be evicted for a live sequence.
    assert pool.num_available == 0
    pool.next_step()
    assert pool.num_available == 3
    pool.resume(1)  # read this step, and now the most recently used
    pool.take("a")  # evicts 2, the least recently used not in use
    assert not pool.has_checkpoint(2) and pool.has_checkpoint(1) and pool.has_checkpoint(3)
    assert pool.add_checkpoint(9) is not None  # evicts 3; 1 is read this step
    assert pool.has_checkpoint(1) and not pool.has_checkpoint(3)
    assert pool.num_available == 0  # 1 busy (read), 9 busy (pending), "a" live


def test_a_checkpoint_in_use_this_step_is_not_dropped() -> None:
    pool = StatePool(2)
    pool.add_checkpoint(1)
    pool.drop(1)  # written this step
    pool.next_step()
    pool.resume(1)
    pool.drop(1)  # read this step
    assert pool.has_checkpoint(1)
    pool.next_step()
    pool.drop(1)
    assert not pool.has_checkpoint(1)


def test_drop_and_clear_free_checkpoint_slots() -> None:
    pool = StatePool(2)
    pool.add_checkpoint(1)
    pool.add_checkpoint(2)
    pool.next_step()
    pool.drop(1)
    assert pool.num_checkpoints == 1 and pool.num_available == 2
    pool.clear()
    assert pool.num_checkpoints == 0 and pool.num_available == 2


def _manager(num_blocks: int = 16, slots: int = 4) -> BlockManager:
    return BlockManager(num_blocks, 4, watermark=0, state_pool=StatePool(slots))


def _prefill(manager: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, 4)
    manager.allocate(seq_id, tokens, hashes)
    manager.cache_full_blocks(seq_id, tokens, len(tokens), hashes)
    return hashes


def test_a_hit_stops_at_the_last_block_a_written_checkpoint_follows() -> None:
    manager = _manager()
    assert manager.state_pool is not None
    tokens = list(range(17))
    _prefill(manager, "a", tokens)
    checkpoint = manager.add_checkpoint("a", 8)  # after two blocks
    assert checkpoint is not None
    assert manager.add_checkpoint("a", 6) is None  # not a block boundary
    manager.free("a")
    # The checkpoint is not written yet: the blocks alone are no hit.
    assert manager.allocate("b", tokens) == 0
    manager.free("b")
    manager.state_pool.next_step()
    assert manager.allocate("c", tokens) == 8
    live, resume = manager.state_slots("c")
    assert resume == checkpoint and live != checkpoint
    assert manager.checkpoint_hint("c") == 16  # the cache held four blocks


def test_no_free_state_slot_makes_a_request_wait() -> None:
    manager = _manager(slots=1)
    manager.allocate("a", [1, 2, 3])
    assert manager.can_allocate([4, 5]) is AllocStatus.LATER
    manager.free("a")
    assert manager.can_allocate([4, 5]) is AllocStatus.OK


def test_evicting_a_block_drops_the_checkpoint_that_follows_it() -> None:
    manager = _manager(num_blocks=4)
    assert manager.state_pool is not None
    tokens = list(range(9))
    _prefill(manager, "a", tokens)
    manager.add_checkpoint("a", 8)
    manager.state_pool.next_step()
    manager.free("a")
    assert manager.state_pool.num_checkpoints == 1
    manager.allocate("b", [100 + i for i in range(16)])  # takes every block: evicts a's
    assert manager.state_pool.num_checkpoints == 0
    manager.free("b")
    manager.reset_prefix_cache()
    assert manager.state_pool.num_available == 4
