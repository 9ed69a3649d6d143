"""One packed forward per engine step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from engine.model.attention_metadata import PagedAttentionMetadata, PrefillChunk


@dataclass(slots=True)
class SequenceChunk:
    """The tokens one sequence computes this step: `token_ids` at positions `start`,
    `start + 1`, ...; `block_table` covers at least `start + len(token_ids)` slots; when
    `sample` is set, the logits of its last token are returned."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    sample: bool


class ModelRunner:
    """Packs the scheduled chunks into one batch, runs the model, returns sampling logits.

    Decode rows (one token) attend in one batched computation; longer chunks are prefills.
    Logits are computed only at the last position of each sampling chunk, in batch order.
    """

    def __init__(self, model: PreTrainedModel, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Return float32 logits `[number of sampling chunks, vocab]`."""
        input_ids: list[int] = []
        logit_index: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        decode_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        for chunk in chunks:
            first = len(input_ids)
            count = len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            chunk_positions = np.arange(chunk.start, chunk.start + count)
            positions.append(chunk_positions)
            table = np.asarray(chunk.block_table, dtype=np.int64)
            slots.append(
                table[chunk_positions // self.block_size] * self.block_size
                + chunk_positions % self.block_size
            )
            if count == 1:
                decode_rows.append(first)
            else:
                context = chunk.start + count
                blocks = torch.as_tensor(table[: -(-context // self.block_size)])
                prefills.append(PrefillChunk(first, first + count, blocks.to(self.device), context))
            if chunk.sample:
                logit_index.append(first + count - 1)

        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(np.concatenate(slots)),
            decode_token_index=self._tensor(np.asarray(decode_rows, dtype=np.int64)),
            prefills=prefills,
            **self._decode_tables(chunks),
        )
        output = self.model(
            input_ids=self._tensor(np.asarray(input_ids, dtype=np.int64))[None],
            position_ids=self._tensor(np.concatenate(positions))[None],
            logits_to_keep=self._tensor(np.asarray(logit_index, dtype=np.int64)),
            use_cache=False,
            paged_metadata=metadata,
        )
        return output.logits[0].float()

    def _decode_tables(self, chunks: Sequence[SequenceChunk]) -> dict[str, torch.Tensor]:
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        context_lens = np.asarray([c.start + 1 for c in decodes], dtype=np.int64)
        width = int(-(-context_lens.max() // self.block_size)) if decodes else 0
        tables = np.zeros((len(decodes), width), dtype=np.int64)
        for row, chunk in enumerate(decodes):
            used = -(-(chunk.start + 1) // self.block_size)
            tables[row, :used] = chunk.block_table[:used]
        return {
            "decode_block_tables": self._tensor(tables),
            "decode_context_lens": self._tensor(context_lens),
        }

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
