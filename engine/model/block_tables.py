"""Every running sequence's block table, kept by the model runner across steps."""

from __future__ import annotations

import numpy as np

from scheduler import SchedulerOutput


class BlockTables:
    """One int64 array with a row per sequence that holds KV blocks, updated by deltas.

    Each step's `SchedulerOutput` says what changed (`freed` sequences, then each scheduled
    sequence's `new_block_ids`), so a step costs what changed, not batch x blocks.
    Invariants: `_rows` maps each sequence id that holds blocks to its row, and
    `table[row, :lengths[row]]` are its block ids in token order; the rest of the row, and
    every row in `_free_rows`, is 0 (block 0: a padding target that exists, never read
    past a context length).

    With `track_changes`, the entries written since the last `drain_changes()` are kept, so
    a copy of the table on another device can follow it by those entries alone (cleared
    entries need not follow: nothing reads past a sequence's length).
    """

    def __init__(
        self, max_num_seqs: int, max_blocks_per_seq: int, track_changes: bool = False
    ) -> None:
        self.table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)
        self.lengths = np.zeros(max_num_seqs, dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._track_changes = track_changes
        self._changed: list[np.ndarray] = []  # flat indices into `table`, written since drain

    def update(self, batch: SchedulerOutput) -> None:
        for seq_id in batch.freed:
            row = self._rows.pop(seq_id)
            self.table[row, : self.lengths[row]] = 0
            self.lengths[row] = 0
            self._free_rows.append(row)
        for item in batch.scheduled:
            if not item.new_block_ids:
                continue
            seq_id = item.seq.seq_id
            if seq_id not in self._rows:
                self._rows[seq_id] = self._free_rows.pop()
            row = self._rows[seq_id]
            start = self.lengths[row]
            end = start + len(item.new_block_ids)
            self.table[row, start:end] = item.new_block_ids
            self.lengths[row] = end
            if self._track_changes:
                self._changed.append(np.arange(start, end) + row * self.table.shape[1])

    def drain_changes(self) -> tuple[np.ndarray, np.ndarray]:
        """The flat indices into `table` written since the last call, and their block ids;
        empty without `track_changes`."""
        flat = np.concatenate(self._changed) if self._changed else np.zeros(0, dtype=np.int64)
        self._changed.clear()
        return flat, self.table.reshape(-1)[flat]

    def row(self, seq_id: str) -> int:
        return self._rows[seq_id]

    def blocks(self, seq_id: str) -> list[int]:
        """A copy of the block ids of `seq_id`, in token order."""
        row = self._rows[seq_id]
        return self.table[row, : self.lengths[row]].tolist()
