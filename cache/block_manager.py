"""Block manager: per-sequence block tables over one shared pool, with prefix caching."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cache.block import BlockHashes, FreeBlockQueue, KVCacheBlock, cdiv, extend_block_hashes
from cache.block_map import block_map
from cache.events import AllBlocksCleared, BlockRemoved, KVEvent, stored_events
from cache.state_pool import StatePool
from cache.stats import CacheStats
from cache.tier import RegisteredBlock

# The prefix id a sequence's first block extends: the empty prefix. Real ids count up from 1.
_EMPTY_PREFIX = 0


class AllocStatus(enum.Enum):
    """Answer of `BlockManager.can_allocate`."""

    OK = enum.auto()  # allocate now
    LATER = enum.auto()  # fits once running sequences free blocks
    NEVER = enum.auto()  # does not fit even in an empty cache: reject the request


@dataclass(slots=True)
class _SeqBlocks:
    """One sequence's block table and how far `cache_full_blocks` has got through it.

    Invariants: each of `blocks[:num_hashed]` was a prefix hit, got registered, or was found
    to duplicate a registered block; `prefix_id` names the token prefix they hold, or is
    None once a hash collision left the prefix without an id (or registration reached a
    released block), which ends registration for this sequence; `prefix_ids[i]` names the
    prefix that ends with block i, for the blocks that have one. `blocks[:num_released]`
    keep their places in the table but are no longer held by it (`release_before`).
    With recurrent state, `resume_slot` is the checkpoint its first chunk reads the state
    from (-1: none, the state starts empty), `kv_hit_blocks` counts the blocks the
    prefix cache held when it was admitted, of which only those up to a checkpoint were
    taken, and `latest` is the prefix id of the checkpoint its generation wrote last
    (None: none), which the next one replaces.
    """

    blocks: list[KVCacheBlock]
    num_hashed: int = 0
    prefix_id: int | None = _EMPTY_PREFIX
    num_released: int = 0
    prefix_ids: list[int] = field(default_factory=list)
    resume_slot: int = -1
    kv_hit_blocks: int = 0
    latest: int | None = None


class BlockManager:
    """Hands out KV-cache blocks to sequences and shares full blocks of equal prefixes.

    Invariants:
    - Every block is either free (`ref_count == 0`, in the free queue exactly once) or used
      (`ref_count` == the number of block tables holding it, not in the queue).
    - `_cached` maps each registered block's hash to that block; only registered blocks carry
      a hash, and a registered block's KV is never overwritten: blocks are written only by
      the sequence that took them fresh from the free queue, which drops any old hash first.
    - Blocks shared by several sequences are full, registered prefix blocks, so no sequence
      writes into a block another one reads.
    - `_num_cached_free` is the number of free blocks that are registered.
    - Prefix ids are never reused, so a hit, confirmed by tokens and parent prefix id, always
      holds exactly the KV of the requested prefix, whatever the hash function returns.

    With `record_events`, every registration, eviction and reset is also kept as a
    `KVEvent` of `medium` until `take_events()`; with `record_registered`, every block
    registered since `take_registered()` (for a tier below, which stores them once their
    KV is written; `reset_prefix_cache` forgets them, whose KV may be unwritten).

    `block_hashes` arguments are the chained hashes of the full blocks of `token_ids`, as
    `extend_block_hashes` computes them (they may run ahead of what a call needs). A caller
    that keeps them across calls, as the scheduler does on each sequence, hashes every
    block once; left out, the call hashes what it needs itself.

    With a `state_pool` (a hybrid model's recurrent layers) every allocated sequence also
    holds a live state slot, and a prefix hit stops at the last hit block that a written
    checkpoint follows (`resume_point`): the attention layers' blocks after it are
    computed again, so the recurrent state is too. Checkpoints are asked for by
    `add_checkpoint` and dropped with the block they follow (eviction, reset).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        record_events: bool = False,
        record_registered: bool = False,
        medium: str = "CPU",
        state_pool: StatePool | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks, block_size > 0; got {num_blocks}, {block_size}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self._blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks)
        self._cached: dict[int, KVCacheBlock] = {}
        self._seqs: dict[str, _SeqBlocks] = {}
        self._next_prefix_id = _EMPTY_PREFIX + 1
        self._num_cached_free = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._evictions = 0
        self.medium = medium
        self._events: list[KVEvent] | None = [] if record_events else None
        self._registered: list[RegisteredBlock] | None = [] if record_registered else None
        self.state_pool = state_pool

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(
        self, token_ids: Sequence[int], block_hashes: list[int] | None = None, reuse: bool = True
    ) -> AllocStatus:
        """Whether `allocate(token_ids, reuse=reuse)` fits now, keeping `watermark_blocks`
        free."""
        num_needed = cdiv(len(token_ids), self.block_size)
        if num_needed > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.state_pool is not None and not self.state_pool.num_available:
            return AllocStatus.LATER
        # Hit blocks in use cost nothing; free ones are revived off the free queue, so they
        # count like new blocks.
        hits = self._find_cached_prefix(token_ids, block_hashes) if reuse else []
        hits = hits[: self.resume_point(hits)]
        num_shared = sum(1 for block in hits if block.ref_count)
        if len(self._free) - (num_needed - num_shared) >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        block_hashes: list[int] | None = None,
        reuse: bool = True,
    ) -> int:
        """Give `seq_id` blocks for all of `token_ids`; return how many tokens were cached.

        The cached count is a multiple of `block_size` and less than `len(token_ids)`; 0
        without `reuse` (every block is new, and still registered as it fills).
        Raises ValueError if `seq_id` already has blocks and RuntimeError if the free blocks
        do not suffice (the caller should have seen `can_allocate(...) is AllocStatus.OK`).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        kv_hits = self._find_cached_prefix(token_ids, block_hashes) if reuse else []
        hits = kv_hits[: self.resume_point(kv_hits)]
        num_new = cdiv(len(token_ids), self.block_size) - len(hits)
        num_revived = sum(1 for block in hits if block.ref_count == 0)
        if num_new + num_revived > len(self._free):
            raise RuntimeError(
                f"sequence {seq_id!r} needs {num_new + num_revived} free blocks, "
                f"{len(self._free)} are free; call can_allocate first"
            )
        # Revive hits before taking new blocks, or popping the front could evict a hit.
        for block in hits:
            if block.ref_count == 0:
                self._free.remove(block)
                self._num_cached_free -= 1
            block.ref_count += 1
        seq = _SeqBlocks(blocks=hits + self._take_free(num_new), num_hashed=len(hits))
        seq.prefix_ids = [block.prefix_id for block in hits if block.prefix_id is not None]
        if hits:
            seq.prefix_id = hits[-1].prefix_id
        if self.state_pool is not None:
            # The checkpoint first, so that taking the live slot cannot evict it.
            if hits:
                resume = self.state_pool.resume(seq.prefix_ids[-1])
                assert resume is not None  # resume_point found it written
                seq.resume_slot = resume
            seq.kv_hit_blocks = len(kv_hits)
            self.state_pool.take(seq_id)
        self._seqs[seq_id] = seq
        num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self._prefix_queries += len(token_ids)
            self._prefix_hits += num_cached_tokens
        return num_cached_tokens

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Make room for `num_tokens` slots in total and return the ids of the blocks this
        added (often none); None, and no change, if the free blocks do not suffice.

        No watermark applies: the reserve exists so that running sequences can grow.
        """
        seq = self._seqs[seq_id]
        num_new = cdiv(num_tokens, self.block_size) - len(seq.blocks)
        if num_new <= 0:
            return []
        if num_new > len(self._free):
            return None
        new_blocks = self._take_free(num_new)
        seq.blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def cache_full_blocks(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        block_hashes: list[int] | None = None,
    ) -> None:
        """Register the blocks of `seq_id` fully covered by the first `num_tokens` tokens.

        Call it when those tokens' KV is (or, within the current step, will be) written, so
        later requests, and siblings admitted in the same step, can share it. Idempotent.
        A block equal to an already registered one (same tokens after the same prefix) stays
        unregistered and the existing entry is kept; on a hash collision with different
        content neither it nor any later block of the sequence is registered.
        """
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        if num_tokens > len(token_ids) or num_tokens > len(seq.blocks) * self.block_size:
            raise ValueError(
                f"cannot cache {num_tokens} tokens of sequence {seq_id!r}: it has "
                f"{len(token_ids)} tokens and {len(seq.blocks)} blocks"
            )
        size = self.block_size
        num_full = num_tokens // size
        if seq.num_hashed >= num_full or seq.prefix_id is None:
            return
        hashes = self._hashes(token_ids, num_full, block_hashes)
        stored: list[RegisteredBlock] = []
        while seq.num_hashed < num_full and seq.prefix_id is not None:
            if seq.num_hashed < seq.num_released:  # another sequence may own it by now
                seq.prefix_id = None
                break
            start = seq.num_hashed * size
            tokens = tuple(token_ids[start : start + size])
            prefix_id = self._register_next(seq, tokens, hashes, stored)
            seq.num_hashed += 1
            seq.prefix_id = prefix_id
            if prefix_id is not None:
                seq.prefix_ids.append(prefix_id)
        if stored:
            self._record_stored(stored)

    def _register_next(
        self,
        seq: _SeqBlocks,
        tokens: tuple[int, ...],
        hashes: list[int],
        stored: list[RegisteredBlock],
    ) -> int | None:
        """Register `seq`'s next unhashed block, holding `tokens`, under its hash in
        `hashes` (appending it to `stored` when registrations are kept) and return the
        prefix id later blocks chain onto: its own, the registered twin's when equal
        content is registered already, or None on a hash collision with other content."""
        block_hash = hashes[seq.num_hashed]
        existing = self._cached.get(block_hash)
        if existing is not None:
            if existing.token_ids == tokens and existing.parent_prefix_id == seq.prefix_id:
                # Same content as ours: later blocks chain onto its prefix, so they are found
                # by lookups that pass through the registered twin.
                return existing.prefix_id
            return None
        prefix_id = self._next_prefix_id
        self._next_prefix_id += 1
        block = seq.blocks[seq.num_hashed]
        block.block_hash = block_hash
        block.token_ids = tokens
        block.prefix_id = prefix_id
        block.parent_prefix_id = seq.prefix_id
        self._cached[block_hash] = block
        if self._events is not None or self._registered is not None:
            parent = hashes[seq.num_hashed - 1] if seq.num_hashed else None
            lora_name = hashes.lora_name if isinstance(hashes, BlockHashes) else None
            stored.append(RegisteredBlock(block.block_id, block_hash, parent, tokens, lora_name))
        return prefix_id

    def _record_stored(self, stored: list[RegisteredBlock]) -> None:
        """Keep one registration call's blocks for `take_registered` and as events."""
        if self._registered is not None:
            self._registered.extend(stored)
        if self._events is not None:
            self._events += stored_events(stored, self.block_size, self.medium)

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (none without `record_events`)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def take_registered(self) -> list[RegisteredBlock]:
        """The blocks registered since the last call, in order of registration (none
        without `record_registered`)."""
        if not self._registered:
            return []
        registered, self._registered = self._registered, []
        return registered

    def free(self, seq_id: str) -> None:
        """Release the blocks of `seq_id`; unknown ids are ignored.

        Blocks keep their hash while free and are evicted only when taken for new use.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if self.state_pool is not None:
            self.state_pool.release(seq_id)
        # Reverse order queues a sequence's tail ahead of the prefix it extends, so the tail
        # is evicted first and the prefix, more likely to be shared, stays cached longer.
        self._unhold(reversed(seq.blocks[seq.num_released :]))

    def resume_point(self, hits: Sequence[KVCacheBlock]) -> int:
        """How many of the prefix hits `hits` a sequence can take: all of them, or with
        recurrent state those up to the last one that a written checkpoint follows."""
        if self.state_pool is None:
            return len(hits)
        for count in range(len(hits), 0, -1):
            prefix_id = hits[count - 1].prefix_id
            if prefix_id is not None and self.state_pool.has_checkpoint(prefix_id):
                return count
        return 0

    def state_slots(self, seq_id: str) -> tuple[int, int]:
        """`seq_id`'s live state slot, and the checkpoint slot its state starts from at its
        admission's first chunk (-1: none). Needs a state pool."""
        assert self.state_pool is not None
        return self.state_pool.slot(seq_id), self._seqs[seq_id].resume_slot

    def checkpoint_hint(self, seq_id: str) -> int:
        """Tokens the prefix cache held for `seq_id` at admission, whether or not a
        checkpoint let it take them: where another sequence's prompt parted from its own, so
        a checkpoint there serves the next sequence that shares the prefix."""
        return self._seqs[seq_id].kv_hit_blocks * self.block_size

    def add_checkpoint(self, seq_id: str, num_tokens: int, latest: bool = False) -> int | None:
        """A state slot for the checkpoint of `seq_id`'s state after its first `num_tokens`
        tokens (a multiple of `block_size`, whose blocks it has registered), keyed by the
        prefix they hold; the step that computes that position writes it. None where
        there is no state pool, that prefix has no id, its checkpoint exists or no slot can
        be had. With `latest` (a checkpoint of its generation) it replaces the sequence's
        latest one: a conversation's next turn resumes from the last."""
        seq = self._seqs[seq_id]
        index, rest = divmod(num_tokens, self.block_size)
        if self.state_pool is None or rest or not 0 < index <= len(seq.prefix_ids):
            return None
        prefix_id = seq.prefix_ids[index - 1]
        slot = self.state_pool.add_checkpoint(prefix_id)
        if latest and slot is not None:
            if seq.latest is not None:
                self.state_pool.drop(seq.latest)
            seq.latest = prefix_id
        return slot

    def release_before(self, seq_id: str, num_tokens: int) -> int:
        """Release the blocks of `seq_id` that hold only tokens before position
        `num_tokens` (a sliding window has passed them) and return how many this call
        released. They keep their places in its block table, so later blocks keep theirs;
        the attention never reads them again, and `free` skips them."""
        seq = self._seqs[seq_id]
        end = min(num_tokens // self.block_size, len(seq.blocks))
        if end <= seq.num_released:
            return 0
        released = seq.blocks[seq.num_released : end]
        seq.num_released = end
        self._unhold(released)
        return len(released)

    def _unhold(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; the ones no table holds any more go free."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def num_held_blocks(self, seq_id: str) -> int:
        """The length of `seq_id`'s block table (released blocks included)."""
        return len(self._seqs[seq_id].blocks)

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the block ids of `seq_id`, in token order."""
        return [block.block_id for block in self._seqs[seq_id].blocks]

    def reset_prefix_cache(self) -> None:
        """Forget every registration; blocks stay where they are and counters keep counting.

        Running sequences register their full blocks again on their next `cache_full_blocks`.
        """
        for block in self._cached.values():
            block.forget_hash()
        self._cached.clear()
        if self.state_pool is not None:
            self.state_pool.clear()
        if self._registered is not None:
            self._registered.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared(self.medium))
        self._num_cached_free = 0
        for seq in self._seqs.values():
            seq.num_hashed = 0
            seq.prefix_id = _EMPTY_PREFIX
            seq.prefix_ids.clear()

    def block_map(self) -> str:
        """Every block's `BlockState` character, by block id; O(num_blocks).

        Invariants, read against `stats()` at the same moment: the map's USED and SHARED
        characters number `used_blocks`, its CACHED ones `cached_blocks`.
        """
        return block_map(self._blocks)

    def stats(self) -> CacheStats:
        num_free = len(self._free)
        num_used = self.num_blocks - num_free
        return CacheStats(
            num_blocks=self.num_blocks,
            used_blocks=num_used,
            free_blocks=num_free,
            cached_blocks=self._num_cached_free,
            usage=num_used / self.num_blocks,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            evictions=self._evictions,
        )

    def _hashes(
        self, token_ids: Sequence[int], num_blocks: int, block_hashes: list[int] | None
    ) -> list[int]:
        """The chained hashes of (at least) the first `num_blocks` full blocks of
        `token_ids`, hashing only what `block_hashes` does not already hold."""
        if block_hashes is None:
            block_hashes = []
        if len(block_hashes) < num_blocks:
            extend_block_hashes(block_hashes, token_ids, self.block_size, num_blocks)
        return block_hashes

    def _find_cached_prefix(
        self, token_ids: Sequence[int], block_hashes: list[int] | None
    ) -> list[KVCacheBlock]:
        """Registered blocks holding the longest run of full blocks of `token_ids[:-1]`.

        The last token is left out so that a fully cached prompt still computes one token
        and yields logits, and so that no shared block is ever written to.
        """
        if not self.enable_prefix_caching or not self._cached:
            return []
        size = self.block_size
        num_candidates = (len(token_ids) - 1) // size
        hashes = self._hashes(token_ids, num_candidates, block_hashes)
        hits: list[KVCacheBlock] = []
        parent_id: int | None = _EMPTY_PREFIX
        for index in range(num_candidates):
            block = self._cached.get(hashes[index])
            if block is None:
                break
            # The hash only finds a candidate; tokens and parent prefix id confirm it.
            start = index * size
            if block.token_ids != tuple(token_ids[start : start + size]):
                break
            if block.parent_prefix_id != parent_id:
                break
            hits.append(block)
            parent_id = block.prefix_id
        return hits

    def _take_free(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks off the free-queue front for new use, evicting lazily."""
        taken = []
        evicted: list[int] = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.block_hash is not None:
                # The hash stayed valid while the block sat free; drop it now that the block
                # will be overwritten, and the checkpoint that followed it.
                del self._cached[block.block_hash]
                if self.state_pool is not None and block.prefix_id is not None:
                    self.state_pool.drop(block.prefix_id)
                evicted.append(block.block_hash)
                block.forget_hash()
                self._num_cached_free -= 1
                self._evictions += 1
            block.ref_count = 1
            taken.append(block)
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(tuple(evicted), self.medium))
        return taken
