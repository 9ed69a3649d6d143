"""One packed forward per engine step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from cache import cdiv
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.block_tables import BlockTables
from scheduler import ScheduledSequence, SchedulerOutput


class ModelRunner:
    """Packs the scheduled chunks into one batch, runs the model, returns sampling logits.

    Every token is a query row of paged attention (see `PagedAttentionMetadata`). Logits
    are computed only at the last position of each sampling chunk, in batch order.
    Block tables live in `block_tables`, kept across steps from the scheduler's outputs:
    call `update_block_tables` with every `SchedulerOutput`, in order, before `execute`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.block_tables = BlockTables(max_num_seqs, cdiv(max_model_len, block_size))

    def update_block_tables(self, batch: SchedulerOutput) -> None:
        self.block_tables.update(batch)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Return float32 logits `[number of sampling chunks, vocab]`."""
        block_size, tables = self.block_size, self.block_tables
        input_ids: list[int] = []
        rows, counts, starts, samples = [], [], [], []
        for item in scheduled:
            input_ids += item.token_ids
            rows.append(tables.row(item.seq.seq_id))
            counts.append(item.num_new_tokens)
            starts.append(item.num_computed_tokens)
            samples.append(item.samples)
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
        width = cdiv(int(context_lens.max()), block_size)
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables.table[row, :width]),
            query_start=self._tensor(query_start),
            context_lens=self._tensor(context_lens),
            query_start_host=query_start,
            context_lens_host=context_lens,
            positions_host=positions,
        )
        output = self.model(
            input_ids=self._tensor(np.asarray(input_ids, dtype=np.int64))[None],
            position_ids=self._tensor(positions)[None],
            logits_to_keep=self._tensor((first + count - 1)[np.asarray(samples, dtype=bool)]),
            use_cache=False,
            paged_metadata=metadata,
        )
        return output.logits[0].float()

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
