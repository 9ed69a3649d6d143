"""Unquantized bf16 linear layers on the C++ row-invariant kernel, for the CPU.

Why. oneDNN's packed bf16 linear (`PackedLinear`) picks its blocking, and with it the
order each output is summed in, by the call's row count on CPUs with AVX512-BF16 (AMX ones
included): rows of 3- to 40-row calls of SmolLM2's 576 -> 1536 and 1536 -> 576 linears
had other bits than the same rows of a 600-row call, so a request's output depended on
what else the engine ran. `kernels/bf16_linear.cpp` sums every output element in one
order fixed by the layer, at every row count (AMX-BF16 where the CPU has it, else
AVX512-BF16's dot products; one of them per process, never one per row count).

Where. bf16 models on CPUs with AVX512-BF16 where the kernel builds (`runs_kernel`), for
each linear with an even number of inputs; elsewhere `PackedLinear` stays, with its
limits (see `packed_linear`). fp32 and fp16 stay on oneDNN, which is row-invariant there.

Bits. Not `F.linear`'s: the kernel sums the same exact products in fp32 in another order
than oneDNN, so outputs differ from `F.linear`'s by about one bf16 rounding step
(`tests/engine/linears/test_bf16_linear.py` bounds the error) and logits are not
transformers' to the bit.

Speed: with AMX it takes less time than oneDNN's packed linear from decode's rows to
prefill's (`python -m bench.linear_kernels --dtypes bfloat16`; whole steps in
`docs/deterministic-outputs.md`). The AVX512-BF16 code alone (what a CPU without AMX
runs) is as fast at 1 row but falls behind from 16 rows on, where AMX's tile products
win: so AMX, where there is AMX, at every row count.

Invariants of a `Bf16Linear`: `packed_weight` is `kernels.bf16_linear.pack(W)` of the
original `[out, in]` bf16 weight W, registered under `handle` with the bias for the op
`pagedserve::bf16_linear`; a row of the output depends only on the same row of the input,
bit for bit.
"""

from __future__ import annotations

import weakref
from types import ModuleType

import torch
from torch import nn

from engine.linears.opaque_linear import OpaqueLinear, fake_linear, fake_linear_group
from engine.model.kernels import bf16_linear


class Bf16Linear(OpaqueLinear):
    """`y = x W^T + b` in bf16 on the row-invariant kernel; inference only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        packed = bf16_linear.pack(linear.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        extension = _load_op()
        extension.register_layer(
            self.handle, packed, self.in_features, self.out_features, self.bias
        )
        weakref.finalize(self, extension.unregister_layer, self.handle)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`pagedserve::bf16_linear`, the C++ op, in eager steps and compiled graphs."""
        return torch.ops.pagedserve.bf16_linear(x, self.handle)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_linear.bf16_linear(x, self.packed_weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 kernel"


def runs_kernel(linear: nn.Linear) -> bool:
    """Whether `linear` becomes a `Bf16Linear`: a bf16 weight on the CPU, an even number of
    inputs, and the kernel available here (built on the first call that gets this far)."""
    return (
        linear.weight.dtype == torch.bfloat16
        and linear.weight.device.type == "cpu"
        and bf16_linear.supports(linear.in_features)
        and bf16_linear.unavailable_reason() is None
    )


_op_loaded = False


def _load_op() -> ModuleType:
    """The kernel's extension, once it has defined `pagedserve::bf16_linear` and its group
    op (loading it registers them) and they have their fakes."""
    global _op_loaded
    extension = bf16_linear.EXTENSION.load()
    if not _op_loaded:
        torch.library.register_fake("pagedserve::bf16_linear")(fake_linear)
        torch.library.register_fake("pagedserve::bf16_linear_group")(fake_linear_group)
        _op_loaded = True
    return extension
