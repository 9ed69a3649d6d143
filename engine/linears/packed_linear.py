"""Linear layers with weights reordered once into oneDNN's blocked layout, for the CPU.

Two reasons to run CPU linears through oneDNN with a packed weight:

- Row invariance. Each row of `x W^T` must have the same bits however many rows are
  computed with it, or a request's output would depend on what else the engine runs
  (see the README's "Deterministic outputs"). MKL's fp32 `F.linear`, which transformers
  uses, sums remainder rows of small batches (1-3, 5-7 and 9-11 rows of a call on an AVX2
  CPU) in another order than rows of large ones. oneDNN's packed linear gives every row
  the same bits for any row count of at least two in fp32 and fp16; a single row takes a
  path of its own for bf16 on AVX-512 CPUs, so `PackedLinear` pads a one-row input to two
  rows. In bf16 oneDNN is not row-invariant on CPUs with AVX512-BF16 (with or without
  AMX): its blocking, and with it the order of each sum, follows the row count (rows of
  3- to 40-row calls had other bits than in a 600-row call). There `pack_linear_layers`
  takes the row-invariant C++ kernel instead (`bf16_linear.Bf16Linear`); bf16 stays on
  oneDNN, with that defect, only where the kernel cannot run (no AVX512-BF16, no C++
  compiler, an odd number of inputs). `tests/engine/linears/test_packed_linear.py` checks every
  layer the engine packs on the CPU it runs on.
- Speed. `F.linear` hands the weight to the library in row-major layout at every call,
  and the library reorders it each time; at decode's small row counts that is a large
  share of the call. Packed, the linears are faster at decode's row counts and as fast
  at prefill's (`python -m bench.linear_kernels`).

The price: in fp32 oneDNN sums in another order than MKL, so logits differ from
transformers' own by about 1e-6 relative (greedy tokens still equal `generate()`'s in
the tests); in bf16 packing is bit-identical to `F.linear` (the row-invariant kernel is
not: see `bf16_linear`). And oneDNN keeps what it builds for every input shape, so calls
are padded to a few row counts (`padded_rows`).

`pack_linear_layers` swaps each `nn.Linear` of a model for a `PackedLinear` (or a
`Bf16Linear`); the packed copy replaces the original weight, which stays alive only where
another module shares it (a tied LM head keeps the input embedding's table).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.linears.bf16_linear import Bf16Linear, runs_kernel
from engine.linears.opaque_linear import OpaqueLinear, free_dropped_handles

# The dtypes packed, each with the check that oneDNN can compute it on this CPU (its fp16
# path, for one, needs AVX512-FP16 or AVX-NE-CONVERT and refuses to reorder without).
SUPPORT_CHECKS = {
    torch.float32: None,
    torch.bfloat16: "_is_mkldnn_bf16_supported",
    torch.float16: "_is_mkldnn_fp16_supported",
}
# oneDNN's smallest row count whose rows share the bits of every larger call's rows.
MIN_ROWS = 2
# Row counts up to this run as they are; above it, see `padded_rows`.
EXACT_ROWS = 15


class PackedLinear(OpaqueLinear):
    """`y = x W^T + b` with W held in oneDNN's blocked layout; inference only.

    Invariants: `packed_weight` is `_reorder_linear_weight(W)` of the original `[out, in]`
    weight, an opaque mkldnn tensor, so the module cannot be moved or trained; a row of
    the output depends only on the same row of the input, bit for bit.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False
        )
        self.bias = linear.bias

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded_to = padded_rows(rows)
        if padded_to == rows:
            return self._linear(x)
        padded = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padded_to - rows))
        return self._linear(padded)[:rows].reshape(*x.shape[:-1], self.out_features)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def padded_rows(rows: int) -> int:
    """The row count a call of `rows` rows is computed with: `rows` itself from MIN_ROWS
    to EXACT_ROWS, else the next multiple of 1/8 of the power of two at or below `rows`
    (16, 18, ..., 30, 32, 36, ..., 60, 64, 72, ...), at least MIN_ROWS.

    oneDNN builds a primitive, JIT-compiled code included, for every input shape and
    keeps it in two LRU caches (ideep's and its own, 1,024 entries each), so each row
    count a step brings, in each linear shape, costs memory for good: for SmolLM2's four
    linear shapes in fp32, calls at every row count from 2 to 1,024 took RSS from 238
    to 2,697 MiB (430 MiB of primitives, then, once the caches evicted and built again,
    2,020 MiB of freed but fragmented heap). Padded, those row counts take 63 shapes, the
    caches never evict, and RSS stayed at 417 MiB with a second pass adding nothing; a
    call pays less than 1/8 more rows. Padding rows are zeros, and a row's bits do not
    depend on the row count (see above), so outputs are unchanged.
    """
    if rows <= EXACT_ROWS:
        return max(rows, MIN_ROWS)
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True on the CPU, for the dtypes listed above, when this torch build and this CPU can
    run oneDNN's linear in that dtype."""
    if device.type != "cpu" or dtype not in SUPPORT_CHECKS:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    if not all(hasattr(mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise")):
        return False
    check = SUPPORT_CHECKS[dtype]
    return check is None or (hasattr(mkldnn, check) and bool(getattr(mkldnn, check)()))


@torch.inference_mode()
def pack_linear_layers(model: nn.Module) -> int:
    """Replace every plain `nn.Linear` of `model` by a `Bf16Linear` where the row-invariant
    bf16 kernel takes it (`bf16_linear.runs_kernel`), else by a `PackedLinear`; return how
    many.

    Call only when `can_pack` holds for the model's device and dtype.
    """
    return replace_linear_layers(
        model, lambda linear: Bf16Linear(linear) if runs_kernel(linear) else PackedLinear(linear)
    )


def replace_linear_layers(model: nn.Module, replacement: Callable[[nn.Linear], nn.Module]) -> int:
    """Swap every plain `nn.Linear` of `model` for `replacement(linear)`, in place; return
    how many were swapped (a replacement that returns the linear itself keeps it)."""
    free_dropped_handles()
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                layer = replacement(child)
                if layer is not child:
                    setattr(parent, name, layer)
                    replaced += 1
    return replaced
