"""BlockManager scenarios: FIFO reuse, prefix hits and revival, lazy eviction, collisions,
watermark admission, growth, stats and reset."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import cache.block
from cache import AllocStatus, BlockManager

BS = 4  # block size in most tests


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def _queue(bm: BlockManager) -> list[int]:
    return [block.block_id for block in bm._free]


def _ref(bm: BlockManager, block_id: int) -> int:
    return bm._blocks[block_id].ref_count


def _run(bm: BlockManager, seq_id: str, tokens: Sequence[int]) -> int:
    """Allocate and register the whole prompt as computed, like a finished prefill."""
    cached = bm.allocate(seq_id, tokens)
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    return cached


def test_all_free_at_start_and_fifo_reuse_in_reverse_free_order() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False, watermark=0)
    assert bm.num_free_blocks == 4 and _queue(bm) == [0, 1, 2, 3]
    assert bm.allocate("a", _tokens(8)) == 0
    bm.allocate("b", _tokens(8, 100))
    assert bm.block_table("a") == [0, 1] and bm.block_table("b") == [2, 3]
    bm.free("b")
    bm.free("a")
    # Each sequence's tail goes in ahead of its head; earlier frees are reused first.
    assert _queue(bm) == [3, 2, 1, 0]
    bm.allocate("c", _tokens(13, 200))
    assert bm.block_table("c") == [3, 2, 1, 0]


def test_cached_block_revived_from_middle_of_free_queue() -> None:
    bm = BlockManager(8, BS, watermark=0)
    prompt = _tokens(9)  # two full blocks and one partial
    assert _run(bm, "a", prompt) == 0
    shared = bm.block_table("a")[:2]
    bm.free("a")
    assert _queue(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.stats().cached_blocks == 2

    assert bm.allocate("b", [*prompt[:8], 99]) == 8
    assert bm.block_table("b") == [*shared, 3]
    assert _queue(bm) == [4, 5, 6, 7, 2]
    assert all(_ref(bm, block_id) == 1 for block_id in shared)
    stats = bm.stats()
    assert (stats.cached_blocks, stats.evictions, stats.used_blocks) == (0, 0, 3)


def test_hit_blocks_at_queue_front_are_revived_not_evicted() -> None:
    bm = BlockManager(3, BS, watermark=0)
    prompt = _tokens(9)
    _run(bm, "a", prompt)
    bm.free("a")  # queue [2, 1, 0]
    bm.allocate("d", _tokens(4, 50))
    bm.free("d")  # queue [1, 0, 2]: hit block 1 is at the front
    assert _queue(bm) == [1, 0, 2]
    assert bm.allocate("b", prompt) == 8
    assert bm.block_table("b") == [0, 1, 2]
    assert bm.stats().evictions == 0


def test_lazy_hash_removal_when_cached_block_is_reused() -> None:
    bm = BlockManager(4, BS, watermark=0)
    prompt = _tokens(9)
    _run(bm, "a", prompt)
    bm.free("a")  # queue [3, 2, 1, 0]; blocks 0 and 1 keep their hashes while free
    assert len(bm._cached) == 2 and bm.stats().cached_blocks == 2

    bm.allocate("x", _tokens(8, 100))  # takes 3 (never hashed) and 2 (partial): no eviction
    assert len(bm._cached) == 2 and bm.stats().evictions == 0
    bm.grow("x", 9)  # takes block 1: its hash goes now
    assert bm.block_table("x") == [3, 2, 1]
    assert bm._blocks[1].block_hash is None and len(bm._cached) == 1
    stats = bm.stats()
    assert (stats.evictions, stats.cached_blocks) == (1, 1)
    bm.free("x")
    assert bm.allocate("b", prompt) == 4  # block 0 is still cached; block 1 no longer is
    assert bm.block_table("b")[0] == 0


def test_shared_prefix_freed_by_one_sequence_stays_cached_for_the_other() -> None:
    bm = BlockManager(10, BS, watermark=0)
    prompt = _tokens(10)
    _run(bm, "a", prompt)
    assert bm.allocate("b", [*prompt[:8], 77, 78]) == 8
    shared = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == shared
    assert [_ref(bm, i) for i in shared] == [2, 2]
    assert bm.block_table("a")[2] != bm.block_table("b")[2]  # partial blocks are private

    bm.free("a")
    assert [_ref(bm, i) for i in shared] == [1, 1]
    assert all(i not in _queue(bm) for i in shared)
    assert all(bm._blocks[i].block_hash is not None for i in shared)
    assert bm.allocate("c", prompt) == 8
    assert bm.block_table("c")[:2] == shared and [_ref(bm, i) for i in shared] == [2, 2]


def test_block_map_tells_free_cached_used_and_shared_blocks_apart() -> None:
    bm = BlockManager(6, BS, watermark=0)
    prompt = _tokens(10)
    _run(bm, "a", prompt)  # blocks 0 and 1 full and registered, 2 partial
    assert bm.block_map() == "uuufff"
    bm.allocate("b", [*prompt[:8], 77])  # shares 0 and 1, takes 3
    assert bm.block_map() == "ssuuff"
    bm.free("a")
    bm.free("b")
    assert bm.block_map() == "ccffff"


def test_forced_hash_collision_is_detected_and_not_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cache.block, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(10, BS, watermark=0)
    _run(bm, "a", _tokens(9))
    # Block 1 collides with block 0 on registration: it stays unregistered.
    assert len(bm._cached) == 1 and bm._cached[42] is bm._blocks[0]
    assert bm.allocate("b", _tokens(9, 100)) == 0  # same hash, other tokens: a miss
    assert bm.allocate("c", _tokens(9)) == 4
    assert bm.stats().prefix_hits == 4


def test_collision_of_parents_is_not_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hash that ignores the parent: equal tokens after different prefixes must miss."""
    monkeypatch.setattr(cache.block, "hash_block", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(12, BS, watermark=0)
    first, other, tail = _tokens(4), _tokens(4, 10), _tokens(4, 20)
    _run(bm, "a", [*first, *tail, 0])  # registers `tail` after `first`
    _run(bm, "d", [*other, 5, 5, 5, 5, 0])  # registers `other` as a first block
    # `other` hits; `tail` finds a's block by hash and by tokens, but its KV follows `first`.
    assert bm.allocate("b", [*other, *tail, 0]) == 4
    assert bm.block_table("b")[1] != bm.block_table("a")[1]


def test_partial_blocks_never_shared_and_last_token_always_computed() -> None:
    bm = BlockManager(10, BS, watermark=0)
    _run(bm, "a", _tokens(6))
    assert len(bm._cached) == 1  # the partial second block is not registered
    assert bm.allocate("b", _tokens(7)) == 4

    _run(bm, "c", _tokens(8, 100))
    assert bm.allocate("d", _tokens(8, 100)) == 4  # whole prompt cached: leave a block to compute
    assert bm.allocate("e", _tokens(9, 100)) == 8


def test_can_allocate_never_later_ok_at_watermark_boundary() -> None:
    bm = BlockManager(10, BS, watermark=0.2)  # 2 blocks in reserve
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(_tokens(8 * BS)) is AllocStatus.OK  # 10 - 8 == 2 left
    assert bm.can_allocate(_tokens(8 * BS + 1)) is AllocStatus.NEVER  # 9 > 10 - 2
    bm.allocate("x", _tokens(1, 500))
    assert bm.can_allocate(_tokens(8 * BS)) is AllocStatus.LATER
    assert bm.can_allocate(_tokens(7 * BS)) is AllocStatus.OK
    bm.free("x")
    assert bm.can_allocate(_tokens(8 * BS)) is AllocStatus.OK


def test_can_allocate_counts_shared_blocks_in_use_but_not_free_ones() -> None:
    bm = BlockManager(10, BS, watermark=0.2)
    prompt = _tokens(7 * BS)
    _run(bm, "a", prompt[:9])  # 3 blocks in use, 2 of them registered; 7 free
    # 7 blocks needed, 2 shared in use: 5 new leave 2 free. Without sharing: LATER.
    assert bm.can_allocate(prompt) is AllocStatus.OK
    assert bm.can_allocate(_tokens(7 * BS, 1000)) is AllocStatus.LATER

    bm.free("a")
    bm.allocate("y", _tokens(1, 500))  # 9 free; the 2 hit blocks are among them
    # Reviving the free hits takes them off the queue: all 8 blocks count, 1 would be left.
    assert bm.can_allocate(_tokens(8 * BS)) is AllocStatus.LATER


def test_allocate_without_room_raises_and_changes_nothing() -> None:
    bm = BlockManager(2, BS, watermark=0)
    before = bm.stats()
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate("a", _tokens(9))
    assert bm.stats() == before and bm.num_free_blocks == 2
    bm.allocate("a", _tokens(8))
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", _tokens(1))


def test_grow_without_room_returns_none_without_side_effects() -> None:
    bm = BlockManager(5, BS, watermark=0.2)  # a reserve of 1 block
    bm.allocate("a", _tokens(8))
    bm.allocate("b", _tokens(8, 100))
    assert bm.grow("a", 8) == [] and bm.block_table("a") == [0, 1]  # already room
    assert bm.grow("a", 9) == [4]  # running sequences may use the reserve
    assert bm.num_free_blocks == 0
    before = bm.stats()
    assert bm.grow("b", 9) is None
    assert bm.block_table("b") == [2, 3] and bm.stats() == before and _queue(bm) == []
    bm.free("a")
    assert bm.grow("b", 16) == bm.block_table("b")[2:] and len(bm.block_table("b")) == 4


def test_stats_count_usage_queries_hits_and_evictions() -> None:
    bm = BlockManager(4, BS, watermark=0)
    _run(bm, "a", _tokens(9))
    bm.free("a")
    stats = bm.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.cached_blocks) == (0, 4, 2)
    assert (stats.prefix_queries, stats.prefix_hits) == (9, 0)

    bm.allocate("b", _tokens(6))
    stats = bm.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.cached_blocks) == (2, 2, 1)
    assert (stats.prefix_queries, stats.prefix_hits, stats.evictions) == (15, 4, 0)
    assert stats.usage == 0.5
    bm.allocate("c", _tokens(8, 100))  # takes block 2 (no hash) and block 1 (hash): 1 eviction
    stats = bm.stats()
    assert (stats.used_blocks, stats.cached_blocks, stats.evictions) == (4, 0, 1)
    assert stats.usage == 1.0


def test_prefix_caching_disabled_never_hits_or_counts() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False, watermark=0)
    _run(bm, "a", _tokens(9))
    bm.free("a")
    assert bm.allocate("b", _tokens(9)) == 0
    stats = bm.stats()
    assert (stats.cached_blocks, stats.prefix_queries, stats.prefix_hits) == (0, 0, 0)


def test_reset_prefix_cache_forgets_hashes_and_running_sequences_reregister() -> None:
    bm = BlockManager(8, BS, watermark=0)
    prompt = _tokens(9)
    _run(bm, "a", prompt)
    _run(bm, "old", _tokens(5, 100))
    bm.free("old")
    bm.reset_prefix_cache()
    assert bm._cached == {} and bm.stats().cached_blocks == 0
    assert all(block.block_hash is None for block in bm._blocks)
    assert bm.allocate("b", prompt) == 0
    assert bm.stats().prefix_queries == 9 + 5 + 9  # counters keep counting

    bm.cache_full_blocks("a", prompt, 9)  # a's blocks get registered again
    assert bm.allocate("c", prompt) == 8
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]


def test_cache_full_blocks_is_idempotent_and_checks_its_arguments() -> None:
    bm = BlockManager(8, BS, watermark=0)
    prompt = _tokens(9)
    bm.allocate("a", prompt)
    bm.cache_full_blocks("a", prompt, 5)
    assert len(bm._cached) == 1
    bm.cache_full_blocks("a", prompt, 9)
    entries = dict(bm._cached)
    bm.cache_full_blocks("a", prompt, 9)
    assert bm._cached == entries and len(entries) == 2
    with pytest.raises(ValueError, match="cannot cache"):
        bm.cache_full_blocks("a", prompt, 13)  # more tokens than blocks hold


def test_generated_tokens_are_shared_after_growth() -> None:
    bm = BlockManager(8, BS, watermark=0)
    tokens = _tokens(3)
    bm.allocate("a", tokens)
    for next_token in range(3, 9):  # decode: each new token gets a slot, then is computed
        tokens.append(next_token)
        assert bm.grow("a", len(tokens)) is not None
        bm.cache_full_blocks("a", tokens, len(tokens))
    assert bm.allocate("b", [*tokens, 100]) == 8


def test_duplicate_block_keeps_existing_entry_and_chains_on() -> None:
    bm = BlockManager(10, BS, watermark=0)
    prompt = _tokens(8)
    _run(bm, "a", prompt)
    # b hits block 0 only (the last block is always computed) and computes its own copy of
    # block 1, then generates a third block after it.
    assert bm.allocate("b", prompt) == 4
    twin = bm.block_table("b")[1]
    tokens = [*prompt, 8, 9, 10, 11]
    assert bm.grow("b", len(tokens)) is not None
    bm.cache_full_blocks("b", tokens, len(tokens))
    assert bm._blocks[twin].block_hash is None  # a's entry is kept
    bm.free("b")
    assert bm.allocate("c", [*tokens, 12]) == 12  # through a's block 1 into b's block 2
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]


def test_free_unknown_is_noop_and_block_table_of_unknown_raises() -> None:
    bm = BlockManager(2, BS)
    bm.free("nobody")
    assert bm.num_free_blocks == 2
    with pytest.raises(KeyError):
        bm.block_table("nobody")


def test_blocks_behind_a_sliding_window_are_released_and_not_freed_twice() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, watermark=0)
    tokens = _tokens(12)
    _run(bm, "a", tokens)
    assert bm.release_before("a", 9) == 2  # tokens 0-7 fill blocks 0 and 1; 8 is in block 2
    assert bm.release_before("a", 9) == 0
    assert bm.num_free_blocks == 8 - 1
    assert bm.block_table("a")[2] == 2  # the later blocks keep their places
    assert bm.release_before("a", 100) == 1  # no further than the table reaches
    bm.free("a")
    assert bm.num_free_blocks == 8
    assert all(_ref(bm, block) == 0 for block in range(8))


def test_a_released_block_shared_with_another_sequence_stays_theirs() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, watermark=0)
    _run(bm, "a", _tokens(9))
    assert _run(bm, "b", _tokens(9)) == 8  # both full blocks hit
    bm.release_before("a", 8)
    assert _ref(bm, 0) == 1 and _ref(bm, 1) == 1
    assert bm.num_free_blocks == 8 - 4


def test_registration_stops_at_a_released_block() -> None:
    # After a reset, a sliding sequence would register its blocks again from the start;
    # a released one may hold another sequence's K/V by then, so it never is.
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, watermark=0)
    tokens = _tokens(12)
    _run(bm, "a", tokens)
    bm.release_before("a", 4)
    bm.reset_prefix_cache()
    bm.cache_full_blocks("a", tokens, 12)
    assert bm.can_allocate([*tokens, 99]) is AllocStatus.OK
    assert bm.allocate("b", [*tokens, 99]) == 0
