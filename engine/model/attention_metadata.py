"""The inputs of paged attention: per step (`PagedAttentionMetadata`, built once per step and
shared by every layer) and per layer (`AttentionFeatures`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.model.recurrent.state import RecurrentStep

if TYPE_CHECKING:
    from engine.model.step_inputs import StepInputs


@dataclass(slots=True)
class DecodePrefillSplit:
    """The step's sequences sorted into decode rows (one query token) and prefill chunks,
    for attention implementations that compute the two differently.

    `decode_rows` are the packed indices of the decode rows' tokens, with their block
    tables and context lengths; `prefills` lists `(sequence, first row, end row)`.
    """

    decode_rows: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: list[tuple[int, int, int]]


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Where this step's new K/V go and what each query row attends to.

    Invariants: `kv_caches` are the engine's KV tensors, one per K/V shape
    (`kv_cache.KVLayout`), all indexed by the same blocks; `slot_mapping[i]` is the KV
    slot of packed token i; sequence b owns the
    packed rows `[query_start[b], query_start[b + 1])`, the last rows of its context of
    `context_lens[b]` tokens (cached tokens, earlier chunks and this step's), which
    `block_tables[b]` stores in order (padded past its last block with block 0);
    `positions_host[i]` is packed token i's position in its sequence; no sequence has more
    than `max_query_len` rows (1 in a pure decode step). The `_host` arrays
    live on the CPU (`query_start` and `context_lens` are copies), for Python-side work
    that must not wait on the device; they are None in a step replayed from a CUDA graph
    or run by a compiled forward (which also leaves `max_query_len` 0: a Python int would
    be compiled in as a constant), which only run attention backends that read the
    tensors alone (`captures`, `compiles`: see `engine.model.attention_backend`).
    `recurrent` is what a hybrid model's recurrent layers read and write (None without).
    """

    kv_caches: tuple[torch.Tensor, ...]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    query_start_host: np.ndarray | None
    context_lens_host: np.ndarray | None
    positions_host: np.ndarray | None
    max_query_len: int
    recurrent: RecurrentStep | None = None
    _split: DecodePrefillSplit | None = field(default=None, repr=False)

    @classmethod
    def of_step(
        cls,
        kv_caches: tuple[torch.Tensor, ...],
        device_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        rows: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        host: StepInputs | None = None,
        max_query_len: int = 0,
        recurrent: RecurrentStep | None = None,
    ) -> PagedAttentionMetadata:
        """The one builder of a step's metadata, for every step path. Each sequence's block
        table is its row `rows[b]` of `device_tables`. With the step's `host` inputs (an
        eager step), the tables are cut to the step's width and the `_host` arrays and
        `max_query_len` come from it; without (a compiled forward, a captured graph:
        device tensors only), the rows are read whole, by `index_select`, and
        `max_query_len` is the caller's (0 in a compiled graph: see above)."""
        if host is None:
            return cls(
                kv_caches, slot_mapping, device_tables.index_select(0, rows), query_start,
                context_lens, None, None, None, max_query_len, recurrent,
            )  # fmt: skip
        return cls(
            kv_caches, slot_mapping, device_tables[rows, : host.width], query_start,
            context_lens, host.query_start, host.context_lens, host.positions,
            host.max_query_len, recurrent,
        )  # fmt: skip

    def decode_prefill_split(self) -> DecodePrefillSplit:
        """The split, computed on the first call of the step and kept for later layers."""
        if self._split is None:
            assert self.query_start_host is not None and self.context_lens_host is not None
            counts = np.diff(self.query_start_host)
            decode = np.flatnonzero(counts == 1)
            device = self.block_tables.device
            index = torch.from_numpy(decode).to(device, non_blocking=True)
            lens = self.context_lens_host[decode]
            width = -(-int(lens.max()) // self.kv_caches[0].shape[3]) if decode.size else 0
            self._split = DecodePrefillSplit(
                decode_rows=torch.from_numpy(self.query_start_host[decode]).to(device),
                decode_block_tables=self.block_tables[index, :width],
                decode_context_lens=torch.from_numpy(lens).to(device),
                prefills=[
                    (int(b), int(self.query_start_host[b]), int(self.query_start_host[b + 1]))
                    for b in np.flatnonzero(counts != 1)
                ],
            )
        return self._split


@dataclass(frozen=True, slots=True)
class AttentionFeatures:
    """What a layer's attention asks beyond causal softmax attention: a row at position p
    sees keys p - sliding_window < t <= p (0: no window); each score s becomes
    softcap * tanh(s / softcap) (0: none); `sinks` `[H]` fp32 adds exp(sinks[h] - max) to
    head h's softmax denominator only (None: none)."""

    sliding_window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
