"""KV-cache events, as vLLM publishes them for external routers: which prefix blocks a
tier (a `medium`) holds from now on, and which it no longer holds.

A block is named by its chained prefix hash (`cache.block.hash_block`), which any process
can compute from token ids alone, so a router that tokenizes a prompt can tell which of
its blocks a server holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.tier import RegisteredBlock

# The media a block can live on, as the events name them: the KV tensor on a GPU or in
# the CPU's RAM, a pool of host RAM beside a GPU's KV tensor, and the disk tier.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence now held by `medium`: `block_hashes[i]`
    holds `token_ids[i * block_size:(i + 1) * block_size]`, chained onto
    `block_hashes[i - 1]`, the first onto `parent_block_hash` (None: the prompt's start)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    # The LoRA adapter whose KV the blocks hold (None: the base model's).
    lora_name: str | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks `medium` no longer holds (evicted for reuse, or dropped from a tier)."""

    block_hashes: tuple[int, ...]
    medium: str


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """Every block of `medium` was forgotten at once (a reset of the prefix cache)."""

    medium: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_events(
    blocks: Sequence[RegisteredBlock], block_size: int, medium: str
) -> list[BlockStored]:
    """`blocks` as BlockStored events, one for each run of blocks that chain onto each
    other, in order."""
    events: list[BlockStored] = []
    run: list[RegisteredBlock] = []
    for block in [*blocks, None]:
        if block is not None and run and block.parent_hash == run[-1].block_hash:
            run.append(block)
            continue
        if run:
            events.append(
                BlockStored(
                    block_hashes=tuple(b.block_hash for b in run),
                    parent_block_hash=run[0].parent_hash,
                    token_ids=tuple(t for b in run for t in b.token_ids),
                    block_size=block_size,
                    medium=medium,
                    lora_name=run[0].lora_name,
                )
            )
        run = [block] if block is not None else []
    return events
