"""A step's model inputs: every running sequence's block table kept across steps, the
step's arrays packed on the host from them, and the one copy that moves both to the device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cache import cdiv
from scheduler import ScheduledSequence, SchedulerOutput


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


@dataclass(slots=True)
class StepInputs:
    """The int64 host arrays of one step, sequence by sequence in the scheduler's order.

    Invariants: sequence b owns packed tokens `[query_start[b], query_start[b + 1])`, the
    last of its `context_lens[b]` tokens; `positions[i]` and `slots[i]` are token i's
    position and KV slot; `rows[b]` is b's row in the block tables, whose first `width`
    columns cover every context; `logits_index` lists the packed indices each chunk samples
    at, in batch order: a sampling chunk's last token, or with draft tokens its last
    `num_draft_tokens + 1` tokens, in order; then its last `num_prompt_rows` entries, the
    packed indices of each chunk's prompt-logprob positions
    (`ScheduledSequence.num_prompt_logprob_rows`: the chunk's first ones), in batch order.
    A hybrid model's steps also carry `state`: each sequence's state slot and source slot,
    then the packed rows after which a checkpoint is copied and its slots, at least one
    (row -1: none), as `RecurrentStep` reads them.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    rows: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    logits_index: np.ndarray
    width: int
    num_prompt_rows: int = 0
    state: tuple[np.ndarray, ...] = ()

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays in the order the runner's forwards take them: input ids, positions,
        slots, rows, query_start, context_lens, logits_index, then `state`'s four."""
        return (
            self.input_ids,
            self.positions,
            self.slots,
            self.rows,
            self.query_start,
            self.context_lens,
            self.logits_index,
            *self.state,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def is_decode(self) -> bool:
        """One token per sequence, every one sampled (and nothing else has logits)."""
        return (
            len(self.input_ids) == len(self.rows) == len(self.logits_index)
            and not self.num_prompt_rows
        )

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start).max()) if len(self.rows) else 0


def build_step_inputs(
    scheduled: Sequence[ScheduledSequence], tables: BlockTables, block_size: int
) -> StepInputs:
    """Pack the scheduled chunks; `tables` must already hold this step's blocks."""
    input_ids: list[int] = []
    rows, counts, starts, sampled, prompt_rows = [], [], [], [], []
    for item in scheduled:
        prompt_rows.append(item.num_prompt_logprob_rows)
        input_ids += item.token_ids
        rows.append(tables.row(item.seq.seq_id))
        counts.append(item.num_new_tokens)
        starts.append(item.num_computed_tokens)
        sampled.append(item.num_sampled_rows)
    row = np.asarray(rows, dtype=np.int64)
    count = np.asarray(counts, dtype=np.int64)
    start = np.asarray(starts, dtype=np.int64)
    query_start = np.concatenate(([0], np.cumsum(count)))
    first = query_start[:-1]  # each chunk's first index in the packed batch
    if len(input_ids) == len(scheduled):  # a pure decode step: one token per sequence
        positions = start
        token_rows = row
    else:
        positions = np.arange(len(input_ids)) + np.repeat(start - first, count)
        token_rows = np.repeat(row, count)
    slots = tables.table[token_rows, positions // block_size] * block_size
    slots += positions % block_size
    context_lens = start + count
    last = first + count - 1
    num_sampled = np.asarray(sampled, dtype=np.int64)
    if len(input_ids) == len(scheduled) or int(num_sampled.max(initial=0)) <= 1:
        logits_index = last[num_sampled.astype(bool)]
    else:  # draft tokens: each sampling chunk's last rows, in order
        ends = np.repeat(last + 1, num_sampled)
        within = np.arange(len(ends)) - np.repeat(np.cumsum(num_sampled) - num_sampled, num_sampled)
        logits_index = ends - np.repeat(num_sampled, num_sampled) + within
    num_prompt = np.asarray(prompt_rows, dtype=np.int64)
    num_prompt_rows = int(num_prompt.sum())
    if num_prompt_rows:
        within = np.arange(num_prompt_rows) - np.repeat(
            np.cumsum(num_prompt) - num_prompt, num_prompt
        )
        logits_index = np.concatenate((logits_index, np.repeat(first, num_prompt) + within))
    return StepInputs(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=positions,
        slots=slots,
        rows=row,
        query_start=query_start,
        context_lens=context_lens,
        logits_index=logits_index,
        width=cdiv(int(context_lens.max()), block_size),
        num_prompt_rows=num_prompt_rows,
        state=_state_arrays(scheduled, first),
    )


def _state_arrays(
    scheduled: Sequence[ScheduledSequence], first: np.ndarray
) -> tuple[np.ndarray, ...]:
    """A hybrid model's `StepInputs.state` (empty without recurrent state): each chunk's
    state slot and source, and its checkpoints' packed rows (that of the position's last
    token) and slots, one padding entry where there are none."""
    states = [item.state for item in scheduled]
    if not states or states[0] is None:
        return ()
    rows, targets = [-1], [0]
    for item, start, state in zip(scheduled, first.tolist(), states, strict=True):
        assert state is not None
        for position, slot in state.checkpoints:
            rows.append(start + position - 1 - item.num_computed_tokens)
            targets.append(slot)
    if len(rows) > 1:
        rows, targets = rows[1:], targets[1:]
    return (
        np.asarray([state.slot for state in states], dtype=np.int64),  # type: ignore[union-attr]
        np.asarray([state.source for state in states], dtype=np.int64),  # type: ignore[union-attr]
        np.asarray(rows, dtype=np.int64),
        np.asarray(targets, dtype=np.int64),
    )


class Staging:
    """Moves int64 host arrays to the device in one copy.

    The arrays are concatenated into one fresh host array (on the CPU, that is all) and
    copied whole; the device tensors are views of the copy. The copy is from pageable
    memory, so it does not overlap the host's work (a reused pinned buffer would).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One device tensor per array (views of one flat tensor), in the arrays' order."""
        flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
        if self.device.type != "cpu":
            flat = flat.to(self.device, non_blocking=True)
        return list(flat.split([array.size for array in arrays]))
