"""What the engine asks of a KV tier below its KV tensor (the disk tier; host RAM beside
a GPU): the component `engine.kv_tiers` implements it, `engine.capabilities.kv_tier` makes one.

A tier holds copies of full prefix blocks under their chained hashes. The engine hands it
every block the prefix cache registers once that block's KV is written (`store`), starts
the loads the scheduler asks for (`start_loads`) and, between steps, has the finished ones
copied into the blocks waiting for them (`finish_loads`). A block read back holds the
same bits as the block it was stored from: the tier checks every copy it reads, and one
that does not check out is dropped and computed again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cache import KVEvent, PrefixTier, RegisteredBlock
from scheduler import TierLoad

# Where a tier sends the KV events of what it stores and drops, from whichever thread
# does it (the event publisher's `publish`, which never blocks).
Publish = Callable[[Sequence[KVEvent]], None]


@dataclass(slots=True, frozen=True)
class TierStats:
    """A tier's occupancy and counters since start. `loads` and `stores` count blocks;
    `drops`, blocks found damaged, truncated or foreign and deleted; `load_seconds` is
    the time from starting each load to its data being ready, summed over `load_count`
    loads (one per sequence)."""

    medium: str
    path: str
    bytes_used: int
    capacity: int
    num_blocks: int
    stores: int
    loads: int
    drops: int
    load_count: int
    load_seconds: float


class KVTier(PrefixTier, Protocol):
    medium: str

    def store(self, blocks: Sequence[RegisteredBlock]) -> None:
        """Keep copies of these registered blocks, whose KV is written now (on the engine's
        thread, before any later step can overwrite them; the writing happens later)."""
        ...

    def start_loads(self, loads: Sequence[TierLoad]) -> None:
        """Begin reading each load's blocks, off the engine's thread."""
        ...

    def finish_loads(self, wait: float = 0.0) -> list[tuple[TierLoad, int]]:
        """Copy the loads read since the last call into their blocks, each whose sequence
        still waits for it (`TierLoad.current`), and return them with how many of their
        first blocks now hold their KV. With none finished but some pending, wait up to
        `wait` seconds for one."""
        ...

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Finish the writes queued (a bounded wait), then stop the tier's threads."""
        ...
