"""Weight-only int8 linear layers for the CPU, through the project's C++ kernel.

`quantization: int8` stores each linear weight as int8 with one symmetric scale per
output channel; activations stay floating point. The kernel (`kernels/int8_linear.cpp`)
widens the codes to fp32 in registers and computes in fp32 (a bf16 model's rows are
widened on the way in and the result rounded once on the way out), so at decode, where
a linear streams its weights from memory once per step, it reads a quarter of the fp32
weights' bytes: on a 2-core AVX2 CPU the decode step's linears of SmolLM2-135M take 3.4x
less time than the packed fp32 linears at one row and 2.3x less at 4 rows
(`python -m bench.linear_kernels`; README, "Quantization"). (PyTorch's own
`_weight_int8pack_mm`, used before, is vectorized for bf16 only and was 2.5x slower than
this kernel at one row. int4 was measured with it and left out: no faster than int8 at
1-4 rows, and an int4 LM head raised perplexity 5%.)

Where it applies. The kernel multiplies every weight into the rows a few at a time,
without a GEMM's register and cache blocking, so its time grows with the row count
faster than a GEMM's: it beats the dense linear up to a row count. A forward of at most
`max_kernel_rows(dtype)` rows (decode at small batches) runs the kernel; a larger one
(prefill, larger batches) runs a `PackedLinear` over the dequantized weight, in the
model's dtype, as fast as the unquantized model. Both paths compute the same quantized
weights, so the model is the same quantized model at every batch size up to rounding: the
order of the sums and, in a bf16 model, the dense copy's rounding of each weight to bf16.
Where the dtype has no fast dense path (bf16 on a CPU without AVX512-BF16 or AMX, which
oneDNN cannot pack), the kernel runs at every row count and no dense copy is kept.

Memory: the codes (a byte a weight and an fp32 scale per output) plus, where there is a
dense path, the dequantized copy in the model's dtype, which takes what the unquantized
engine's packed weight took. So the mode adds memory there: SmolLM2-135M's weights in
fp32 grow from 0.65 GB to 0.79 GB. Without a dense path it saves memory: in bf16 0.27 GB
becomes 0.19 GB. A tied LM head is quantized as a copy (the largest matrix); the input
embedding keeps its table.

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

from engine.model.kernels import int8_linear
from engine.model.opaque_linear import OpaqueLinear
from engine.model.packed_linear import PackedLinear, can_pack, replace_linear_layers

MODES = ("int8",)
# Largest row count that runs the kernel, by the model's dtype. fp32: measured by
# `python -m bench.linear_kernels` on a 2-core AVX2 CPU, where the decode step's linears
# take 3.4x less time on the kernel than on the packed fp32 linear at one row, 1.1-1.3x
# less at 16 rows, and 0.8-0.9x from 24 (README, "Quantization"). bf16 against oneDNN's
# packed bf16 (AVX512-BF16, AMX CPUs) is not measured in this project: 8 is a guess, lower
# than fp32's because packed bf16 reads half the bytes of packed fp32 and computes faster.
KERNEL_ROWS = {torch.float32: 16, torch.bfloat16: 8}


def max_kernel_rows(dtype: torch.dtype) -> int | None:
    """The largest row count that runs the quantized kernel in a model of `dtype`; None:
    every row count, where the dtype has no fast dense path on this CPU (bf16 that oneDNN
    cannot pack runs `F.linear`)."""
    if dtype == torch.bfloat16 and not can_pack(torch.device("cpu"), dtype):
        return None
    return KERNEL_ROWS[dtype]


def unavailable_reason(device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """Why `mode` cannot run on `device` in `dtype`, or None if it can: it needs the CPU,
    fp32 or bf16, the C++ kernel and, for fp32, oneDNN for the dense path."""
    if mode not in MODES:
        return f"unknown mode {mode!r}"
    if device.type != "cpu":
        return "it runs on the CPU only"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 or bfloat16 models, not {dtype}"
    if dtype == torch.float32 and not can_pack(device, dtype):
        return "its dense path for more rows needs oneDNN (torch.backends.mkldnn)"
    reason = int8_linear.EXTENSION.unavailable_reason()
    return None if reason is None else f"its C++ kernel cannot be built here: {reason}"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: `(codes [N, K] int8, scales [N] fp32)`, with
    `weight ≈ codes * scales[:, None]`; the scales are rounded to bf16 (8 significant bits)
    before the codes are chosen, so that `codes * scales` is exact in fp32 and the kernel
    and the dense copy compute with the same weights."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).bfloat16().float()
    codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales[:, None]  # exact in fp32: 8 x 8 significant bits


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
        """The int8 kernel over any number of rows."""
        flat = x.reshape(-1, self.in_features).contiguous()
        y = int8_linear.int8_linear(flat, self.codes, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        rows = "all" if self.kernel_rows is None else f"<={self.kernel_rows}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8, kernel rows {rows}"
        )


@torch.inference_mode()
def quantize_linear_layers(model: nn.Module, mode: str, kernel_rows: int | None) -> int:
    """Replace every plain `nn.Linear` of `model` by a `QuantizedLinear` of `mode` (int8)
    with `kernel_rows` (the engine passes `max_kernel_rows`; None runs the kernel at every
    row count); return how many. Call only where `unavailable_reason` gives None for the
    model's device, dtype and `mode`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}")
    return replace_linear_layers(model, lambda linear: QuantizedLinear(linear, kernel_rows))
