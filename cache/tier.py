"""What the scheduler asks of a KV tier below the KV tensor (the disk tier, host RAM):
whether it holds the blocks a prefix lookup did not find in memory."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Protocol


class PrefixTier(Protocol):
    def lookup(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes`, from the first on, the tier holds. A guess that a
        load confirms: a block found damaged or gone then is computed instead."""
        ...


@dataclass(slots=True, frozen=True)
class RegisteredBlock:
    """A block the prefix cache registered: `block_id` holds the KV of `token_ids`
    following the prefix `parent_hash` names (None: the sequence's start)."""

    block_id: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    # The LoRA adapter whose KV it holds (None: the base model's).
    lora_name: str | None = None


def held_prefix(block_hashes: Sequence[int], held: Container[int]) -> int:
    """How many of the chained `block_hashes`, from the first on, are in `held` (a chained
    hash stands for its whole prefix, so the first miss ends the run)."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in held:
            break
        count += 1
    return count
