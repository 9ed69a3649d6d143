"""A snapshot of the block manager's occupancy and prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CacheStats:
    """Block counts at one moment plus counters since the manager was created.

    Invariants: `used_blocks + free_blocks == num_blocks`; `cached_blocks <= free_blocks`
    (free blocks that still hold a prefix-cache hash and can be revived by a hit);
    `usage == used_blocks / num_blocks`; `prefix_hits <= prefix_queries` (both in tokens);
    `evictions` counts cached blocks whose hash was dropped because the block was reused.
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    evictions: int
