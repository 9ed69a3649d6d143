"""Random allocate/step/free/reset sequences against the BlockManager's invariants.

The machine plays the scheduler and the model: it allocates prompts, computes them in
chunks and decodes (growing the block table), registers full blocks, frees and resets.
It tracks which token prefix each block's KV was written for, so it can check that a
prefix hit or a hash entry never points at KV of other tokens, even with a weak hash.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from unittest import mock

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from cache import AllocStatus, BlockManager, BlockState

# Prompts that often start alike, and only two token values, make prefix hits, duplicate
# blocks and (with the weak hash) collisions frequent.
_BASES = ((), (0, 0, 1, 1, 0, 1, 0, 0), (0, 0, 1, 1, 1, 1, 0, 1), (1, 0, 1, 0, 1, 1, 1, 0))
TOKENS = st.builds(
    lambda base, tail: [*base, *tail],
    st.sampled_from(_BASES),
    st.lists(st.integers(0, 1), min_size=1, max_size=4),
)
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass(slots=True)
class _Seq:
    tokens: list[int]
    num_computed: int


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.seqs: dict[str, _Seq] = {}
        self.next_seq = 0
        # block id -> the token prefix (up to the block's last written slot) its KV was
        # written for; prefix id -> the tokens it named when first seen (ids are never reused)
        self.written: dict[int, tuple[int, ...]] = {}
        self.prefixes: dict[int, tuple[int, ...]] = {0: ()}

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.integers(1, 4),
        watermark=st.sampled_from([0.0, 0.1, 0.3]),
        enable_prefix_caching=st.booleans() | st.just(True),
    )
    def setup(
        self, num_blocks: int, block_size: int, watermark: float, enable_prefix_caching: bool
    ) -> None:
        self.bm = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            watermark=watermark,
        )

    def _pick(self, index: int) -> str | None:
        # Rules pick a sequence by index rather than by precondition, so no draw is rejected.
        return sorted(self.seqs)[index % len(self.seqs)] if self.seqs else None

    @rule(tokens=TOKENS)
    def allocate(self, tokens: list[int]) -> None:
        bm, size = self.bm, self.bm.block_size
        num_needed = -(-len(tokens) // size)
        status = bm.can_allocate(tokens)
        assert (status is AllocStatus.NEVER) == (num_needed > bm.num_blocks - bm.watermark_blocks)
        if status is not AllocStatus.OK:
            return
        seq_id = f"s{self.next_seq}"
        self.next_seq += 1
        cached = bm.allocate(seq_id, tokens)
        assert cached % size == 0 and 0 <= cached < len(tokens)
        assert bm.num_free_blocks >= bm.watermark_blocks
        table = bm.block_table(seq_id)
        assert len(table) == num_needed
        for index, block_id in enumerate(table[: cached // size]):
            assert self.written[block_id] == tuple(tokens[: (index + 1) * size])
        self.seqs[seq_id] = _Seq(list(tokens), cached)

    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12), sampled=st.integers(0, 1))
    def step(self, index: int, chunk: int, sampled: int) -> None:
        """Compute a prefill chunk, or sample a token and compute it (a decode step)."""
        bm, size = self.bm, self.bm.block_size
        seq_id = self._pick(index)
        if seq_id is None:
            return
        seq = self.seqs[seq_id]
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(sampled)
        chunk = min(chunk, len(seq.tokens) - seq.num_computed)
        table, free = bm.block_table(seq_id), bm.num_free_blocks
        if bm.grow(seq_id, seq.num_computed + chunk) is None:
            assert bm.block_table(seq_id) == table and bm.num_free_blocks == free
            return
        table = bm.block_table(seq_id)
        for position in range(seq.num_computed, seq.num_computed + chunk):
            block = bm._blocks[table[position // size]]
            # Only a sequence's own, unregistered blocks are ever written.
            assert block.ref_count == 1 and block.block_hash is None
            self.written[block.block_id] = tuple(seq.tokens[: position + 1])
        seq.num_computed += chunk
        bm.cache_full_blocks(seq_id, seq.tokens, seq.num_computed)

    @rule(index=st.integers(0, 100))
    def cache_again(self, index: int) -> None:
        seq_id = self._pick(index)
        if seq_id is None:
            return
        seq = self.seqs[seq_id]
        # The first call catches up after a reset; a second one must change nothing.
        self.bm.cache_full_blocks(seq_id, seq.tokens, seq.num_computed)
        entries = dict(self.bm._cached)
        self.bm.cache_full_blocks(seq_id, seq.tokens, seq.num_computed)
        assert self.bm._cached == entries

    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq_id = self._pick(index)
        if seq_id is None:
            return
        del self.seqs[seq_id]
        self.bm.free(seq_id)
        self.bm.free(seq_id)  # a second free is a no-op

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll:  # rare, so that the cache fills up between resets
            return
        self.bm.reset_prefix_cache()
        assert self.bm.stats().cached_blocks == 0

    @invariant()
    def each_block_free_or_used(self) -> None:
        bm = self.bm
        tables = [bm.block_table(seq_id) for seq_id in self.seqs]
        assert all(len(set(table)) == len(table) for table in tables)
        holders = Counter(block_id for table in tables for block_id in table)
        queued = Counter(block.block_id for block in bm._free)
        assert len(bm._free) == bm.num_free_blocks == sum(queued.values())
        for block in bm._blocks:
            assert block.ref_count == holders[block.block_id]
            assert queued[block.block_id] == (1 if block.ref_count == 0 else 0)

    @invariant()
    def hash_entries_hold_their_tokens(self) -> None:
        bm, size = self.bm, self.bm.block_size
        assert sum(block.block_hash is not None for block in bm._blocks) == len(bm._cached)
        for block_hash, block in bm._cached.items():
            assert block.block_hash == block_hash and block.prefix_id is not None
            assert block.token_ids is not None and len(block.token_ids) == size
            content = self.written[block.block_id]
            assert len(content) % size == 0 and content[-size:] == block.token_ids
            assert self.prefixes.setdefault(block.prefix_id, content) == content
        for block in bm._cached.values():
            assert block.parent_prefix_id is not None and block.token_ids is not None
            parent = self.prefixes[block.parent_prefix_id]
            assert self.written[block.block_id] == parent + block.token_ids

    @invariant()
    def stats_agree(self) -> None:
        bm = self.bm
        stats = bm.stats()
        free_cached = sum(b.ref_count == 0 and b.block_hash is not None for b in bm._blocks)
        assert stats.free_blocks == bm.num_free_blocks
        assert stats.used_blocks + stats.free_blocks == stats.num_blocks == bm.num_blocks
        assert stats.cached_blocks == free_cached
        assert stats.usage == stats.used_blocks / stats.num_blocks
        assert 0 <= stats.prefix_hits <= stats.prefix_queries

    @invariant()
    def block_map_agrees(self) -> None:
        bm = self.bm
        states = bm.block_map()
        assert len(states) == bm.num_blocks
        for block, state in zip(bm._blocks, states, strict=True):
            if block.ref_count:
                assert state == (BlockState.USED if block.ref_count == 1 else BlockState.SHARED)
            else:
                assert state == (BlockState.FREE if block.block_hash is None else BlockState.CACHED)
        stats = bm.stats()
        assert states.count(BlockState.USED) + states.count(BlockState.SHARED) == stats.used_blocks
        assert states.count(BlockState.CACHED) == stats.cached_blocks

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq_id in list(self.seqs):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(block.ref_count == 0 for block in self.bm._blocks)
        assert self.bm.stats().used_blocks == 0


class WeakHashMachine(BlockManagerMachine):
    """The same, with a hash that ignores the parent and collides all the time."""

    def __init__(self) -> None:
        super().__init__()
        self._patch = mock.patch("cache.block.hash_block", lambda parent, tokens: sum(tokens) % 3)
        self._patch.start()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._patch.stop()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = SETTINGS
TestWeakHashMachine = WeakHashMachine.TestCase
TestWeakHashMachine.settings = SETTINGS
