"""The router's prediction of each replica's prefix cache, built from what it routed there.

No replica is asked: a block hash is recorded for a replica when the router sends it a
request whose prompt holds that block, and forgotten in the order the replica's own cache
would evict it. A replica's block manager frees a finished sequence's blocks last block
first, and reuses free blocks least recently freed first, so the deepest blocks of the
least recently used prompts go first; `record` orders the index the same way, and keeps at
most the replica's number of KV blocks. The prediction errs when other traffic reaches a
replica, on the blocks of requests still running (the cache cannot evict those) and on
the blocks of generated tokens (cached too, taking room); an error costs a cache miss,
never a wrong answer, since a replica checks every hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from cache import held_prefix


class PrefixIndex:
    """Per replica, the block hashes it is predicted to hold, least recently used first.

    Invariants: a replica's hashes are at most the capacity last given for it; for every
    recorded prompt, its block i is used more recently than its block i + 1, as the
    replica's cache keeps them.
    """

    def __init__(self) -> None:
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these chained `hashes` the replica
        is predicted to hold (a chained hash stands for its whole prefix, so the first
        miss ends the match, as in the block manager's lookup)."""
        return held_prefix(hashes, self._blocks.get(replica, {}))

    def record(self, replica: Hashable, hashes: Sequence[int], capacity: int | None) -> None:
        """The replica now holds these blocks, most recently used; keep at most `capacity`
        blocks for it (None: unknown yet, keep all)."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for block_hash in reversed(hashes):
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        if capacity is not None:
            while len(blocks) > capacity:
                blocks.popitem(last=False)

    def size(self, replica: Hashable) -> int:
        """How many blocks the replica is predicted to hold."""
        return len(self._blocks.get(replica, ()))

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in `replicas` (a restarted replica has a new id and an
        empty cache)."""
        keep = set(replicas)
        for replica in [r for r in self._blocks if r not in keep]:
            del self._blocks[replica]
