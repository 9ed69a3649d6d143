"""The paged KV tensors: preallocated, holding every attending layer's keys and values,
one tensor per shape of K/V (a group of layers), all indexed by the same block ids.

A group's layout is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`;
index 0 of the second axis is K, 1 is V. Slot `s` of a layer is block `s // block_size`,
offset `s % block_size`, so a `[num_blocks * block_size, heads, dim]` view addresses
slots. Most models have one group; Gemma 4's sliding and global layers have two (head
sizes 256 and 512), each holding blocks of its own shape, so a block costs the sum of the
groups' bytes rather than every layer padded to the largest.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers whose K and V have one shape per token: `num_kv_heads` heads of
    `head_dim` (K and V of different head sizes are padded to the larger, see
    `attention`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size


@dataclass(frozen=True)
class KVLayout:
    """Where each layer's K/V live and how far back they are read.

    `groups` are the K/V shapes, one tensor each; `layers` maps each attending layer of the
    model to (group, index in that group's tensor). Layers that read another layer's K/V
    (Gemma 4's and Gemma 3n's KV sharing) map to that layer's place; a hybrid's recurrent
    layers are in no group. With `sliding_window` > 0 every layer attends to that many last
    positions at most, so what lies further back can be released (0: some layer attends
    to everything).
    """

    groups: tuple[KVGroup, ...]
    layers: dict[int, tuple[int, int]]
    sliding_window: int = 0

    @classmethod
    def uniform(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, sliding_window: int = 0
    ) -> KVLayout:
        """Every one of `num_layers` layers attends, in one shape, at its own index."""
        layers = {layer: (0, layer) for layer in range(num_layers)}
        return cls((KVGroup(num_layers, num_kv_heads, head_dim),), layers, sliding_window)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVLayout:
        """The layout a plain decoder's config promises (every layer attends alike)."""
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls.uniform(text.num_hidden_layers, kv_heads, head_dim)

    @property
    def head_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({group.head_dim for group in self.groups}))

    def bytes_per_block(self, block_size: int, dtype_size: int) -> int:
        """One block across every group: K and V of each layer for `block_size` tokens."""
        return block_size * sum(group.bytes_per_token(dtype_size) for group in self.groups)

    def describe(self) -> str:
        """The shapes, for logs and the disk tier's key: one group as before groups
        existed, so a dense model's disk folders keep their key."""
        shapes = [
            f"KVLayout(num_layers={g.num_layers}, num_kv_heads={g.num_kv_heads}, "
            f"head_dim={g.head_dim}, sliding_window={self.sliding_window})"
            for g in self.groups
        ]
        return shapes[0] if len(shapes) == 1 else " + ".join(shapes)


def allocate_kv_cache(
    layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """One tensor per group. Zeroed so that padding slots read by batched decode attention
    are finite. On the CPU the zeros are an anonymous memory map's: the kernel hands out
    (zeroed) pages as they are first touched, so start-up does not write the whole cache
    and resident memory grows with the KV actually used."""
    return tuple(
        zeros((g.num_layers, 2, num_blocks, block_size, g.num_kv_heads, g.head_dim), dtype, device)
        for g in layout.groups
    )


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor; on the CPU an anonymous private memory map, whose pages the
    kernel hands out when first written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: `sleep.release_tensor` gives a private mapping's pages back to the system.
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
