"""Copies of whole KV blocks between the paged KV tensors and host memory, the one place
a tier touches the KV cache (on a GPU, through pinned host memory)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockCopier:
    """Gathers blocks out of, and scatters them into, the KV tensors (one per K/V shape,
    each of layout `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`).

    A host copy of n blocks is one contiguous tensor `[n, values per block]`: block i's
    values are `copy[i]`, each tensor's `[num_layers, 2, block_size, num_kv_heads,
    head_dim]` in turn, in the same order in every process. Both directions copy values as
    they are: a block scattered back holds the bits it was gathered with.
    """

    def __init__(self, kv_caches: tuple[torch.Tensor, ...]) -> None:
        self.kv_caches = kv_caches
        # Views, block first, and each tensor's values per block.
        self._by_block = [kv.permute(2, 0, 1, 3, 4, 5) for kv in kv_caches]
        self._sizes = [view[0].numel() for view in self._by_block]
        self.dtype = kv_caches[0].dtype
        self.device = kv_caches[0].device
        self.block_bytes = sum(self._sizes) * kv_caches[0].element_size()
        self._pin = self.device.type == "cuda"

    def host_buffer(self, num_blocks: int) -> torch.Tensor:
        """An uninitialised host tensor for `num_blocks` blocks (pinned on a GPU)."""
        shape = (num_blocks, sum(self._sizes))
        return torch.empty(shape, dtype=self.dtype, pin_memory=self._pin)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of the blocks, taken now: later writes to them do not reach it."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [view[index].reshape(len(block_ids), -1) for view in self._by_block]
        blocks = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if not self._pin:
            return blocks  # advanced indexing made a new tensor already
        host = self.host_buffer(len(block_ids))
        host.copy_(blocks)  # synchronous: the copy is whole when this returns
        return host

    def scatter(self, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Write `host[i]` into block `block_ids[i]` of the KV tensors (in stream order on
        a GPU, so the next step's forward reads them)."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = host[: len(block_ids)].to(self.device, non_blocking=self._pin)
        for view, part in zip(self._by_block, data.split(self._sizes, dim=1), strict=True):
            view[index] = part.view(len(block_ids), *view.shape[1:])
