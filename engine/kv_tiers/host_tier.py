"""Host RAM beside a GPU's KV tensor (vLLM's `kv_offloading_size`): a pool of pinned host
memory holding copies of prefix blocks, least recently used ones replaced first.

Every registered block is copied into the pool once its KV is written (one gather per
step, device to pinned host memory), and a prefix lookup that stops in the KV tensor goes
on in the pool; a hit is copied back at once, in stream order, so the sequence runs in the
next step. On the CPU the engine refuses this tier: the KV tensor is host RAM already.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache import MEDIUM_CPU, BlockRemoved, RegisteredBlock, held_prefix, stored_events
from engine.kv_tier import Publish, TierStats
from engine.kv_tiers.block_copy import BlockCopier
from scheduler import TierLoad


@dataclass(slots=True, frozen=True)
class _Slot:
    """Where a block's copy lives in the pool, and what it holds (checked on a hit)."""

    index: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class HostTier:
    """A `KVTier` (engine/kv_tier.py) of `capacity` bytes of host memory.

    Invariants: `_index` maps each held block's hash to its slot, in order of last use;
    a slot is in `_index` or in `_free`, never both; `_finished` holds the loads copied in
    since the last `finish_loads`.
    """

    medium = MEDIUM_CPU

    def __init__(
        self, kv_caches: tuple[torch.Tensor, ...], capacity: int, block_size: int,
        publish: Publish | None = None,
    ) -> None:  # fmt: skip
        self._copier = BlockCopier(kv_caches)
        self.block_size = block_size
        self.capacity = capacity
        num_slots = capacity // self._copier.block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offloading_size {capacity} B holds no block: one takes "
                f"{self._copier.block_bytes} B"
            )
        self._pool = self._copier.host_buffer(num_slots)
        self._index: OrderedDict[int, _Slot] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._finished: list[tuple[TierLoad, int]] = []
        self._publish = publish
        self._stores = self._loads = self._load_count = 0

    def lookup(self, block_hashes: Sequence[int]) -> int:
        return held_prefix(block_hashes, self._index)

    def store(self, blocks: Sequence[RegisteredBlock]) -> None:
        todo = list({b.block_hash: b for b in blocks if b.block_hash not in self._index}.values())
        todo = todo[-len(self._pool) :]  # more than the pool holds: the newest
        if not todo:
            return
        evicted = []
        slots = []
        for block in todo:
            if not self._free:
                old_hash, old = self._index.popitem(last=False)
                evicted.append(old_hash)
                self._free.append(old.index)
            slot = _Slot(self._free.pop(), block.parent_hash, block.token_ids)
            self._index[block.block_hash] = slot
            slots.append(slot.index)
        self._pool[torch.tensor(slots)] = self._copier.gather([b.block_id for b in todo])
        if self._publish is not None:
            removed = [BlockRemoved(tuple(evicted), self.medium)] if evicted else []
            self._publish(removed + stored_events(todo, self.block_size, self.medium))
        self._stores += len(todo)

    def start_loads(self, loads: Sequence[TierLoad]) -> None:
        for load in loads:
            slots = []
            for block in load.expected_blocks(self.block_size):
                slot = self._index.get(block.block_hash)
                if slot is None or (slot.parent_hash, slot.token_ids) != (
                    block.parent_hash,
                    block.token_ids,
                ):
                    break
                self._index.move_to_end(block.block_hash)
                slots.append(slot.index)
            if slots and load.current:
                self._copier.scatter(load.block_ids[: len(slots)], self._pool[torch.tensor(slots)])
            self._finished.append((load, len(slots)))
            self._loads += len(slots)
            self._load_count += 1

    def finish_loads(self, wait: float = 0.0) -> list[tuple[TierLoad, int]]:
        finished, self._finished = self._finished, []
        return finished

    def stats(self) -> TierStats:
        used = len(self._index) * self._copier.block_bytes
        return TierStats(
            medium=self.medium, path="host memory", bytes_used=used,
            capacity=self.capacity, num_blocks=len(self._index), stores=self._stores,
            loads=self._loads, drops=0, load_count=self._load_count, load_seconds=0.0,
        )  # fmt: skip

    def close(self) -> None:
        """Nothing to finish: every copy was made when it was asked for."""
