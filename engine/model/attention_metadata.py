"""Per-step inputs of paged attention, built once per step and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    """Query tokens `[token_start, token_end)` of the packed batch belonging to one sequence
    whose context (cached tokens, earlier chunks and this chunk) is `context_len` tokens,
    stored in `block_ids` in order."""

    token_start: int
    token_end: int
    block_ids: torch.Tensor
    context_len: int


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Where this step's new K/V go and what each query attends to.

    Invariants: `slot_mapping[i]` is the KV slot of packed token i; decode rows are
    sequences with exactly one query token, `decode_block_tables[b]` lists row b's blocks
    (padded with block 0) and `decode_context_lens[b]` is its context length; every
    other sequence of the step appears once in `prefills`.
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    decode_token_index: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: list[PrefillChunk]
