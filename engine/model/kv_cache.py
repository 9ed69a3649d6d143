"""The paged KV tensor: one preallocated tensor holding every layer's keys and values.

Layout `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; index 0 of
the second axis is K, 1 is V. Slot `s` of a layer is block `s // block_size`, offset
`s % block_size`, so a `[num_blocks * block_size, heads, dim]` view addresses slots.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The per-token shape of a model's KV cache, and how far back it is read: with
    `sliding_window` > 0 every layer attends to that many last positions at most, so what
    lies further back can be released (0: some layer attends to everything).

    `attention_layers` are the model's layer indices that attend, ascending, where some do
    not (a hybrid's others keep recurrent state instead): layer `attention_layers[i]` keeps
    its K/V at index i of the KV tensor. Empty where every layer attends (and left out of
    the repr, which keys the disk tier's folders)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int = 0
    attention_layers: tuple[int, ...] = field(default=(), repr=False)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVLayout:
        """The layout a plain decoder's config promises (every layer attends alike)."""
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv_heads, head_dim)

    def kv_index(self) -> dict[int, int] | None:
        """Model layer index -> its index in the KV tensor; None where every layer
        attends, each at its own index."""
        if not self.attention_layers:
            return None
        return {layer: index for index, layer in enumerate(self.attention_layers)}


def allocate_kv_cache(
    layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Zeroed so that padding slots read by batched decode attention are finite. On the CPU
    the zeros are an anonymous memory map's: the kernel hands out (zeroed) pages as they are
    first touched, so start-up does not write the whole cache and resident memory grows
    with the KV actually used."""
    shape = (layout.num_layers, 2, num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: `sleep.release_tensor` gives a private mapping's pages back to the system.
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
