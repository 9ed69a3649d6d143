"""Linear layers with weights reordered once into oneDNN's blocked layout, for the CPU.

`torch.nn.functional.linear` on the CPU hands the weight to oneDNN (or MKL) in PyTorch's
row-major layout at every call, and the library reorders it internally each time. For the
small row counts of decode steps that reorder is a large share of the call: packing the
weights once at load time makes SmolLM2's decode-step matmuls ~20% faster at batch 64 and
up to ~2x faster at batch 1-16 in bf16. Results are bit-identical to `F.linear` in bf16
(and in fp16 on CPUs whose oneDNN computes it; the tests check whichever this CPU
has); in fp32 oneDNN may sum in another order (differences of about 1e-6 relative), so
fp32 keeps `F.linear` and with it exact equality with transformers' `generate()`.

`pack_linear_layers` swaps each `nn.Linear` of a model for a `PackedLinear`; the packed
copy replaces the original weight, which stays alive only where another module shares it
(a tied LM head keeps the input embedding's table).
"""

from __future__ import annotations

import torch
from torch import nn

# The dtypes packed, each with the check that oneDNN can compute it on this CPU (its fp16
# path, for one, needs AVX512-FP16 or AVX-NE-CONVERT and refuses to reorder without).
SUPPORT_CHECKS = {
    torch.bfloat16: "_is_mkldnn_bf16_supported",
    torch.float16: "_is_mkldnn_fp16_supported",
}


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held in oneDNN's blocked layout; inference only.

    Invariant: `packed_weight` is `_reorder_linear_weight(W)` of the original `[out, in]`
    weight; it is an opaque mkldnn tensor, so the module cannot be moved or trained.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True on the CPU, for the dtypes where packing is exact (see module), when this torch
    build and this CPU can run oneDNN's linear in that dtype."""
    if device.type != "cpu" or dtype not in SUPPORT_CHECKS:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    check = SUPPORT_CHECKS[dtype]
    required = (check, "_reorder_linear_weight", "_linear_pointwise")
    return all(hasattr(mkldnn, name) for name in required) and bool(getattr(mkldnn, check)())


@torch.inference_mode()
def pack_linear_layers(model: nn.Module) -> int:
    """Replace every plain `nn.Linear` of `model` by a `PackedLinear`; return how many.

    Call only when `can_pack` holds for the model's device and dtype.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
