"""The K/V store and the C++ paged attention as `torch.library` ops, for compiled forwards.

`torch.compile` cannot trace into a pybind function, and a graph break at every layer
would undo what compiling buys. Registered as ops with fake implementations, both stay
single calls inside one graph, and Inductor orders them by what they read and write.

Both take the whole KV tensor `[num_layers, 2, num_blocks, block_size, Hkv, D]` and a
layer index, not one layer's K and V views: Inductor mishandles an op that mutates two
views of one base (the mutation was lost and attention read wrong values), and one
mutated graph input has no such aliasing.
"""

from __future__ import annotations

import torch

from engine.model.kernels.paged_attention import paged_attention as cpp_paged_attention
from engine.model.kernels.paged_attention import store_kv as cpp_store_kv


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write key and value `[T, Hkv, D]` into one layer's caches at `slots` `[T]` (all
    valid): the eager attention path's store, and the op's below."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


# The project's ops, in one library: these two, and the linear op (`opaque_linear`). Plain
# `Library` definitions, not `torch.library.custom_op`, whose Python wrapper costs more per
# call: with custom_op the linear cost about 20 µs more a call (one 576x576 linear), and
# `torch.profiler` over compiled SmolLM2 int8 decode steps gave the store 195 µs a call
# (5.8 ms a step; then 137 µs, about half of it dropping the padding row by a mask, which
# the C++ store now skips) and the attention 109 µs (then 84 µs).
LIBRARY = torch.library.Library("pagedserve", "FRAGMENT")
LIBRARY.define(
    "store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, int layer, Tensor slots) -> ()"
)
LIBRARY.define(
    "paged_attention(Tensor q, Tensor kv_cache, int layer, Tensor block_tables, "
    "Tensor query_start, Tensor context_lens, float scale) -> Tensor"
)


def _store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int, slots: torch.Tensor
) -> None:
    """Write key and value `[T, Hkv, D]` into `kv_cache[layer]` at `slots` `[T]`; a token
    whose slot is negative (a padding row) is not written. The C++ kernel's store: the
    same copies as `write_kv`, without a mask or a host sync to drop padding rows."""
    cpp_store_kv(key, value, kv_cache, layer, slots)


def _paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The C++ kernel's `paged_attention` over `kv_cache[layer]`; returns a contiguous
    `[T, H, D]` (its fake says so too, or compiled code would read it with q's strides)."""
    k_cache, v_cache = kv_cache[layer]
    return cpp_paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale)


LIBRARY.impl("store_kv", _store_kv, "CPU")
LIBRARY.impl("paged_attention", _paged_attention, "CPU")
store_kv = torch.ops.pagedserve.store_kv
paged_attention = torch.ops.pagedserve.paged_attention


@torch.library.register_fake("pagedserve::store_kv")
def _(*args: object) -> None:
    return None


@torch.library.register_fake("pagedserve::paged_attention")
def _(q: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty(q.shape)
