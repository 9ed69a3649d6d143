"""The project's registered ops, for compiled forwards.

`torch.compile` cannot trace into a pybind function, and a graph break at every layer
would undo what compiling buys, so the calls that hold the arithmetic are ops of the
`pagedserve` library, kept as single calls inside one graph and ordered by what they read
and write:
- `linear(x, handle)` (`opaque_linear`): a packed linear, defined here, computed in Python;
- `quantized_linear(x, handle)` (`kernels/group_linear.cpp`): the quantized linears, in C++;
- `bf16_linear(x, handle)` (`kernels/bf16_linear.cpp`): the unquantized bf16 linears on
  the row-invariant kernel, in C++ (both linear ops have a `_group` twin for layers that
  read one input, `linear_groups`);
- `store_kv` and `paged_attention` (`kernels/paged_attention.cpp`): the K/V store and the
  paged attention kernel, in C++, defined when that extension loads (`register_kernel_ops`
  adds their fakes). They take the whole KV tensor `[num_layers, 2, num_blocks,
  block_size, Hkv, D]` and a layer index, not one layer's K and V views: Inductor
  mishandles an op that mutates two views of one base (the mutation was lost and
  attention read wrong values), and one mutated graph input has no such aliasing.

Ops defined in C++ run with no Python between a compiled graph and the kernel: with the
K/V store and the attention as Python-implemented ops, `torch.profiler` over compiled
SmolLM2 int8 decode steps gave the store 137 µs a call (half of it dropping the padding
row by a mask) and the attention 84 µs, 30 calls each a step. (`torch.library.custom_op`'s
Python wrapper cost more still: the store took 195 µs a call with it.)
"""

from __future__ import annotations

import torch

from engine.model.kernels import paged_attention as attention_kernel

# The op library of the linears computed in Python (`opaque_linear`).
LIBRARY = torch.library.Library("pagedserve", "FRAGMENT")
_kernel_ops_registered = False


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write key and value `[T, Hkv, D]` into one layer's caches at `slots` `[T]` (all
    valid): the eager attention path's store."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def register_kernel_ops() -> None:
    """Load the C++ attention extension, which defines `pagedserve::store_kv` and
    `pagedserve::paged_attention`, and give the ops their fakes. Idempotent; raises
    `KernelUnavailableError` where the kernel cannot be built. Call before `store_kv`,
    `paged_attention` or compiling a forward that uses them."""
    global _kernel_ops_registered
    if _kernel_ops_registered:
        return
    attention_kernel.EXTENSION.load()
    torch.library.register_fake("pagedserve::store_kv")(_fake_store_kv)
    torch.library.register_fake("pagedserve::paged_attention")(_fake_paged_attention)
    _kernel_ops_registered = True


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int, slots: torch.Tensor
) -> None:
    """Write key and value `[T, Hkv, D]` into `kv_cache[layer]` at `slots` `[T]` (int64); a
    token whose slot is negative (a padding row) is not written."""
    torch.ops.pagedserve.store_kv(key, value, kv_cache, layer, slots)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C++ kernel's `paged_attention` over `kv_cache[layer]`, with its sliding window,
    softcap and sinks (see `kernels.paged_attention.paged_attention`): a contiguous
    `[T, H, D]` (its fake says so too, or compiled code would read it with q's strides)."""
    return torch.ops.pagedserve.paged_attention(
        q,
        kv_cache,
        layer,
        block_tables,
        query_start,
        context_lens,
        scale,
        sliding_window,
        softcap,
        sinks,
    )


def _fake_store_kv(*args: object) -> None:
    return None


def _fake_paged_attention(q: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty(q.shape)
