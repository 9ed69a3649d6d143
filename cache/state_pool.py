"""Slots of recurrent state, for hybrid models: each running sequence's state, and prefix
checkpoints (the state after a registered block) that a prefix hit resumes from.

A recurrent layer (Gated DeltaNet, Mamba-2, a short convolution) keeps one fixed-size
state per sequence instead of K/V per token, so a prefix hit needs the state at the hit's
end as well as the attention layers' blocks, and a state cannot be cut at any token. The
block manager asks this pool for a checkpoint at the block where a hit would stop
(`BlockManager.resume_point`), keyed by that block's prefix id, and drops it when the
block is evicted. Integers only: the states themselves live in the engine.
"""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    """`num_slots` slots, each holding one sequence's state of every recurrent layer.

    A slot is free, live (the running state of one sequence: `take`, `release`) or a
    checkpoint (a copy of a state after the registered block whose prefix id keys it:
    `add_checkpoint`). Checkpoints are a cache: a live slot or a new checkpoint takes a
    free slot first, else the least recently used checkpoint's.

    Invariants:
    - Every slot is in exactly one of `_free`, `_live`'s values and `_checkpoints`' values.
    - A checkpoint added in a step is written by that step's forward: until `next_step()`
      (called as the next step is scheduled) it is pending, found by no lookup, and no
      slot in `_busy` is evicted: neither pending ones nor those a sequence admitted in this
      step resumes from (`resume`), which the step reads.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"need num_slots > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._live: dict[str, int] = {}
        # prefix id -> slot, least recently used first.
        self._checkpoints: OrderedDict[int, int] = OrderedDict()
        self._pending: set[int] = set()  # prefix ids whose checkpoint this step writes
        self._busy: set[int] = set()  # slots this step writes or reads as checkpoints

    @property
    def num_available(self) -> int:
        """Slots a live sequence could take now: free ones and evictable checkpoints."""
        return len(self._free) + len(self._checkpoints) - len(self._busy)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def take(self, seq_id: str) -> int:
        """A slot for `seq_id`'s running state; RuntimeError where none is available
        (check `num_available` first)."""
        if seq_id in self._live:
            raise ValueError(f"sequence {seq_id!r} already has a state slot")
        slot = self._take_slot()
        if slot is None:
            raise RuntimeError(f"no state slot for {seq_id!r}: check num_available first")
        self._live[seq_id] = slot
        return slot

    def slot(self, seq_id: str) -> int:
        return self._live[seq_id]

    def release(self, seq_id: str) -> None:
        """Free `seq_id`'s slot; unknown ids are ignored."""
        slot = self._live.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def resume(self, prefix_id: int) -> int | None:
        """The slot of the checkpoint after the block `prefix_id` names (None: none is
        written yet), kept from eviction for this step, which reads it."""
        slot = self._checkpoints.get(prefix_id)
        if slot is None or prefix_id in self._pending:
            return None
        self._checkpoints.move_to_end(prefix_id)
        self._busy.add(slot)
        return slot

    def has_checkpoint(self, prefix_id: int) -> bool:
        """Whether a written checkpoint follows the block `prefix_id` names."""
        return prefix_id in self._checkpoints and prefix_id not in self._pending

    def add_checkpoint(self, prefix_id: int) -> int | None:
        """A slot for a checkpoint after the block `prefix_id` names, which this step
        writes; None where one exists already or no slot can be had."""
        if prefix_id in self._checkpoints:
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._checkpoints[prefix_id] = slot
        self._pending.add(prefix_id)
        self._busy.add(slot)
        return slot

    def drop(self, prefix_id: int) -> None:
        """Forget the checkpoint after the block `prefix_id` names (its block was evicted,
        or a later checkpoint replaces it), unless this step reads or writes it: then it
        stays, for eviction in its turn."""
        slot = self._checkpoints.get(prefix_id)
        if slot is not None and slot not in self._busy:
            del self._checkpoints[prefix_id]
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache was reset)."""
        self._free += self._checkpoints.values()
        self._checkpoints.clear()
        self._pending.clear()

    def next_step(self) -> None:
        """The previous step has written its checkpoints: they are found from now on, and
        nothing is held from eviction."""
        self._pending.clear()
        self._busy.clear()

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for prefix_id, slot in self._checkpoints.items():
            if slot not in self._busy:
                del self._checkpoints[prefix_id]
                return slot
        return None
