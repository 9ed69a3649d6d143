"""The project's registered ops, for compiled forwards.

`torch.compile` cannot trace into a pybind function, and a graph break at every layer
would undo what compiling buys, so the calls that hold the arithmetic are ops of the
`pagedserve` library, kept as single calls inside one graph and ordered by what they read
and write:
- `linear(x, handle)` (`opaque_linear`): a packed linear, defined in `LIBRARY` here,
  computed in Python;
- `quantized_linear(x, handle)` (`kernels/group_linear.cpp`): the quantized linears, in C++;
- `bf16_linear(x, handle)` (`kernels/bf16_linear.cpp`): the unquantized bf16 linears on
  the row-invariant kernel, in C++ (both linear ops have a `_group` twin for layers that
  read one input, `linear_groups`);
- `store_kv` and `paged_attention` (`kernels/paged_attention.cpp`): the `cpp` attention
  backend's K/V store and kernel, in C++, defined when that extension loads
  (`kernels.paged_attention.register_kernel_ops` adds their fakes).

Ops defined in C++ run with no Python between a compiled graph and the kernel: with the
K/V store and the attention as Python-implemented ops, `torch.profiler` over compiled
SmolLM2 int8 decode steps gave the store 137 µs a call (half of it dropping the padding
row by a mask) and the attention 84 µs, 30 calls each a step. (`torch.library.custom_op`'s
Python wrapper cost more still: the store took 195 µs a call with it.)
"""

from __future__ import annotations

import torch

# The op library of the linears computed in Python (`opaque_linear`).
LIBRARY = torch.library.Library("pagedserve", "FRAGMENT")
