"""Copies of whole KV blocks between the paged KV tensor and host memory, the one place
a tier touches the KV tensor (on a GPU, through pinned host memory)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockCopier:
    """Gathers blocks out of, and scatters them into, a KV tensor of layout
    `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

    A host copy of n blocks is one contiguous tensor `[n, num_layers, 2, block_size,
    num_kv_heads, head_dim]`, so block i's bytes are `copy[i]`, in the same order in every
    process. Both directions copy values as they are: a block scattered back holds the
    bits it was gathered with.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._by_block = kv_cache.permute(2, 0, 1, 3, 4, 5)  # a view: block first
        self.block_shape = tuple(self._by_block.shape[1:])
        self.dtype = kv_cache.dtype
        self.block_bytes = self._by_block[0].numel() * kv_cache.element_size()
        self._pin = kv_cache.device.type == "cuda"

    def host_buffer(self, num_blocks: int) -> torch.Tensor:
        """An uninitialised host tensor for `num_blocks` blocks (pinned on a GPU)."""
        return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype, pin_memory=self._pin)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of the blocks, taken now: later writes to them do not reach it."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        blocks = self._by_block[index]
        if not self._pin:
            return blocks  # advanced indexing made a new tensor already
        host = self.host_buffer(len(block_ids))
        host.copy_(blocks)  # synchronous: the copy is whole when this returns
        return host

    def scatter(self, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Write `host[i]` into block `block_ids[i]` of the KV tensor (in stream order on a
        GPU, so the next step's forward reads them)."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        data = host[: len(block_ids)].to(self.kv_cache.device, non_blocking=self._pin)
        self._by_block[index] = data
