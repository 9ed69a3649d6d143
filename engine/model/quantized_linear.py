"""Weight-only int8 linear layers for the CPU, through PyTorch's own kernel.

`quantization: int8` stores each linear weight as int8 with one symmetric scale per
output channel; activations stay floating point. The kernel is
`torch.ops.aten._weight_int8pack_mm`; on x86 it is vectorized for bf16 activations only
(with fp32 ones it runs a scalar loop, 4x slower than the packed fp32 linear at one row on
an AVX2 CPU and worse at more), so the kernel path computes in bf16 in every model: an
fp32 model's rows are rounded to bf16 on the way in, and the kernel's bf16 result is
widened on the way out. (int4, `_weight_int4pack_mm_for_cpu` with groups of 32, was
measured and left out: no faster than int8 on the decoder's linears at 1-4 rows, and an
int4 LM head, where it was faster, raised perplexity 5%; README, "Quantization".)

Where it applies. The kernel dequantizes every weight again for each block of 4 rows and
blocks nothing for the caches, so its time grows about linearly with the row count, a
GEMM's far less: it beats the dense linear only at small row counts. A forward of at most
`max_kernel_rows(dtype)` rows (decode at small batches) runs the kernel; a larger one
(prefill, larger batches) runs a `PackedLinear` over the dequantized weight, in the
model's dtype, as fast as the unquantized model. Both paths compute the same quantized
weights, so the model is the same quantized model at every batch size up to rounding:
the kernel path's bf16 rounding of the layer's input and output, the order of the sums
and, in a bf16 model, the dense copy's rounding of each weight to bf16. Where the dtype
has no fast dense path (bf16 on a CPU without AVX512-BF16 or AMX, which oneDNN cannot
pack), the kernel runs at every row count and no dense copy is kept.

Memory: the codes (a byte a weight and a bf16 scale per output) plus, where there is a
dense path, the dequantized copy in the model's dtype, which takes what the unquantized
engine's packed weight took. So the mode adds memory there: SmolLM2-135M's weights in
fp32 grow from 0.65 GB to 0.79 GB. Without a dense path it saves memory: in bf16 0.27 GB
becomes 0.19 GB. A tied LM head is quantized as a copy (the largest matrix, and a quarter
of a decode step's linear time at one row); the input embedding keeps its table.

Invariants of a `QuantizedLinear`:
- Within either path a row's output bits depend only on that row (the kernel computes
  each output element alone, over the inputs in a fixed order; `PackedLinear` is
  row-invariant), for any row count.
- Across the threshold they do not: the same row computed in a forward of at most
  `kernel_rows` rows and in a larger one differs in its last bits. So with quantization a
  request's logits can depend on how many rows the steps that computed them had, which
  the unquantized engine's "Deterministic outputs" (README) exclude; where the kernel runs
  at every row count, they do not.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.opaque_linear import OpaqueLinear
from engine.model.packed_linear import PackedLinear, can_pack, replace_linear_layers

MODES = ("int8",)
KERNEL_DTYPE = torch.bfloat16
# The kernel steps over the inputs in whole vectors (16 bf16 on AVX-512) with aligned
# loads and checks nothing: other input counts read past the row (and compute garbage).
IN_FEATURES_MULTIPLE = 16
# Largest row count that runs the kernel, by the model's dtype. fp32: measured by
# `python -m bench.linear_kernels` on a 2-core AVX2 CPU, where the kernel beats the packed
# fp32 linear up to 4 rows, is even at 8 and slower from 16 (README, "Quantization"). bf16
# against oneDNN's packed bf16 (AVX512-BF16, AMX CPUs) is not measured in this project: 4
# interpolates a measurement on such a CPU (the kernel 1.7-2x faster at 1 row, 3x slower
# at 32).
KERNEL_ROWS = {torch.float32: 4, torch.bfloat16: 4}


def max_kernel_rows(dtype: torch.dtype) -> int | None:
    """The largest row count that runs the quantized kernel in a model of `dtype`; None:
    every row count, where the dtype has no fast dense path on this CPU (bf16 that oneDNN
    cannot pack runs `F.linear`: as fast as the kernel at one row, 1.5-4x slower from 2 to
    512 rows)."""
    if dtype == torch.bfloat16 and not can_pack(torch.device("cpu"), dtype):
        return None
    return KERNEL_ROWS[dtype]


def can_quantize(device: torch.device, dtype: torch.dtype, mode: str) -> bool:
    """True when `mode` can run on `device` in `dtype`: the CPU, fp32 or bf16, a torch with
    the mode's kernel and, for fp32, oneDNN for the dense path."""
    if mode not in MODES or device.type != "cpu":
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    return dtype == torch.bfloat16 or can_pack(device, dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: `(codes [N, K] int8, scales [N] bf16)`, with
    `weight ≈ codes * scales[:, None]`; the scales are rounded to bf16 before the codes
    are chosen, so the codes fit the scales the kernel reads."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).to(KERNEL_DTYPE)
    codes = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]  # exact in fp32: 8 x 8 significant bits


class QuantizedLinear(OpaqueLinear):
    """`y = x Wq^T + b` for the int8-quantized weight Wq of an `nn.Linear`; inference only.

    Invariants: `codes, scales = quantize_int8(W)` of the original weight W; `kernel_rows`
    is None (the kernel runs at every row count and `dense` is None) or a positive row
    count, and then `dense` is a `PackedLinear` over `dequantize_int8(codes, scales)` in
    W's dtype; a forward of at most `kernel_rows` rows runs `kernel`, a larger one `dense`.
    """

    def __init__(self, linear: nn.Linear, kernel_rows: int | None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernel_rows = kernel_rows
        self.bias = linear.bias
        weight = linear.weight.detach()
        codes, scales = quantize_int8(weight)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.dense = None
        if kernel_rows is not None:
            plain = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
            dequantized = dequantize_int8(codes, scales).to(weight.dtype)
            plain.weight = nn.Parameter(dequantized, requires_grad=False)
            plain.bias = linear.bias
            self.dense = PackedLinear(plain)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.dense is not None and rows > self.kernel_rows:
            return self.dense.compute(x)
        return self.kernel(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 kernel over any number of rows, in bf16."""
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        rows = "all" if self.kernel_rows is None else f"<={self.kernel_rows}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8, kernel rows {rows}"
        )


@torch.inference_mode()
def quantize_linear_layers(model: nn.Module, mode: str, kernel_rows: int | None) -> int:
    """Replace every plain `nn.Linear` of `model` whose input count the kernel takes by a
    `QuantizedLinear` of `mode` (int8) with `kernel_rows` (the engine passes
    `max_kernel_rows`; None runs the kernel at every row count); return how many. Other
    linears stay as they are. Call only when `can_quantize` holds for the model's device,
    dtype and `mode`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}")
    return replace_linear_layers(
        model,
        lambda linear: QuantizedLinear(linear, kernel_rows),
        where=lambda linear: linear.in_features % IN_FEATURES_MULTIPLE == 0,
    )
