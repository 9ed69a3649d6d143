"""Weight-only group-quantized linear layers for the CPU (`quantization: int8 | int4`).

Each linear weight is stored as 8- or 4-bit codes with an fp16 scale and offset per group
of 32 inputs (`kernels.group_linear`; 4 bits is llama.cpp's Q4_1). `int8` quantizes every
linear to 8 bits; `int4` quantizes the decoder's linears to 4 bits and the LM head, the
largest and most sensitive matrix, to 8 bits, as llama.cpp's Q4 files keep theirs in 8.
The default model's GGUF holds its linears in Q4_1: `int4` gives back those very weights.

Why. At decode a linear streams its weights from memory once per step, so its time is its
bytes: SmolLM2-135M's linears are 270 MB in bf16, 151 MB in `int8` and 98 MB in `int4`.
The kernel quantizes each activation row to int8 per group and multiplies with integer dot
products (AVX512-VNNI), as llama.cpp does, so the arithmetic keeps up with the memory;
that quantization is part of the model the mode computes (README, "Quantization", gives
its perplexity).

Where it applies. With AVX512-VNNI the kernel runs at every row count: its integer dot
products beat oneDNN's packed fp32 and bf16 linears from 1 to 96 rows and on 512-row
prefill windows on a CPU without AMX. Where the CPU has AMX-INT8, calls of 16 rows or more
(prefill chunks, decode batches) run their blocks of 16 rows on AMX tiles, with the same
bits (the header of `kernels/group_linear.cpp`): faster than VNNI alone, though slower
than oneDNN's AMX-bf16 linear on 512-row bf16 calls (`python -m bench.linear_kernels`).
Without VNNI, its scalar twin runs calls of at most `max_kernel_rows(dtype)` rows (decode
at small batches) and a larger call runs a `PackedLinear` over the dequantized weight in
the model's dtype, as fast as the unquantized model; where the dtype has no fast dense
path (bf16 on a CPU without AVX512-BF16 or AMX, which oneDNN cannot pack), the kernel runs
at every row count. No dense copy is kept where the kernel takes every row count.

Memory: the codes, scales and offsets, plus the dequantized copy in the model's dtype
where there is a dense path. A tied LM head is quantized as a copy; the input embedding
keeps its table.

Invariants of a `QuantizedLinear`:
- Within either path a row's output bits depend only on that row (the kernel computes
  each output element alone, in a fixed order; `PackedLinear` is row-invariant).
- Where there is a threshold, bits differ across it: the kernel quantizes its inputs and
  the dense path does not, so a request's logits can depend on how many rows the steps
  that computed them had, which "Deterministic outputs" (README) excludes. Where the
  kernel runs at every row count (AVX512-VNNI), they do not.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import torch
from torch import nn

from engine.linears import quantized_store
from engine.linears.opaque_linear import (
    OpaqueLinear,
    fake_linear,
    fake_linear_group,
    opaque_linear,
)
from engine.linears.packed_linear import PackedLinear, can_pack, replace_linear_layers
from engine.model.kernels import group_linear

# Bits of the decoder's linears per mode; the LM head takes HEAD_BITS in every mode.
MODES = {"int8": 8, "int4": 4}
HEAD_BITS = 8
SCHEME_NAMES = {
    group_linear.AFFINE: "affine",
    group_linear.SUPER_MIN: "super-min",
    group_linear.SUPER_SIGNED: "super-signed",
}
# Largest row count that runs the kernel where it is the scalar twin (neither AVX512-VNNI nor
# AVX2), by the model's dtype; more rows dequantize and run the dense linear. With VNNI or
# AVX2 the kernel runs at every row count.
KERNEL_ROWS = {torch.float32: 16, torch.bfloat16: 8}
VECTOR_INSTRUCTIONS = ("avx512-vnni", "avx2")


def max_kernel_rows(dtype: torch.dtype) -> int | None:
    """The largest row count that runs the quantized kernel in a model of `dtype`; None:
    every row count. With AVX512-VNNI the kernel beats oneDNN's packed linear from 1 to 96
    rows (`python -m bench.linear_kernels`; README, "Quantization") and on 512-row prefill
    windows; with AVX2 it runs every row count too, so that a GGUF's
    weights are held once, in their own bits. Without either, `KERNEL_ROWS`, except where
    the dtype has no fast dense path (bf16 that oneDNN cannot pack runs `F.linear`). Needs
    the kernel built."""
    if group_linear.EXTENSION.load().instruction_set in VECTOR_INSTRUCTIONS:
        return None
    if dtype == torch.bfloat16 and not can_pack(torch.device("cpu"), dtype):
        return None
    return KERNEL_ROWS[dtype]


def unavailable_reason(device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """Why `mode` ("gguf", a GGUF's own types, or one of `MODES`) cannot run on `device` in
    `dtype`, or None if it can: it needs the CPU, fp32 or bf16, the C++ kernel and, for
    fp32, oneDNN for the dense path."""
    if mode not in (*MODES, "gguf"):
        return f"unknown mode {mode!r}"
    if device.type != "cpu":
        return "it runs on the CPU only"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 or bfloat16 models, not {dtype}"
    if dtype == torch.float32 and not can_pack(device, dtype):
        return "its dense path for more rows needs oneDNN (torch.backends.mkldnn)"
    reason = group_linear.EXTENSION.unavailable_reason()
    return None if reason is None else f"its C++ kernel cannot be built here: {reason}"


class QuantizedLinear(OpaqueLinear):
    """`y = x Wq^T + b` for a group-quantized weight Wq; inference only.

    Invariants: `weight` is Wq packed (`group_linear.PackedWeight`: codes quantized from a
    checkpoint's weight by `group_linear.quantize`, or a GGUF's blocks as they are);
    `kernel_rows` is None (the kernel runs at every row count and `dense` is None) or a
    positive row count, and then `dense` is a `PackedLinear` over Wq unpacked to `dtype`; a
    forward of at most `kernel_rows` rows runs `kernel`, a larger one `dense`.

    `order` (int64 `[in_features]`, a permutation, or None) is an input order: the layer
    computes `x[..., order] Wq^T + b`, the weight `W = Wq[:, argsort(order)]` whose
    columns Wq holds in another order (a GGUF's blocks as stored, whose columns no block
    order can put back: Qwen3.5's value heads in K-quant super-blocks). `forward` gathers
    `x` before the op, each row alone; `compute` and `kernel` take inputs already in
    `order`. It is a buffer, which a compiled graph reads as a tensor, and `extra_repr`
    names its digest, so a graph's key changes with it.
    """

    def __init__(
        self,
        weight: group_linear.PackedWeight,
        bias: nn.Parameter | None,
        kernel_rows: int | None,
        dtype: torch.dtype,
        order: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if order is not None and not torch.equal(
            torch.sort(order).values, torch.arange(weight.in_features)
        ):
            raise ValueError("an input order must be a permutation of the layer's inputs")
        self.register_buffer(
            "order", None if order is None else order.to(torch.int64), persistent=False
        )
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bits = weight.bits
        self.kernel_rows = kernel_rows
        self.bias = bias
        self.weight = weight
        self.dense = None
        if kernel_rows is not None:
            plain = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
            unpacked = group_linear.unpack(weight).to(dtype)
            plain.weight = nn.Parameter(unpacked, requires_grad=False)
            plain.bias = bias
            self.dense = PackedLinear(plain)
        extension = _load_op()
        extension.register_layer(
            self.handle, weight.codes, weight.scales, weight.offsets, weight.sub, weight.bits,
            weight.scheme, self.in_features, self.out_features,
            -1 if kernel_rows is None else kernel_rows, self.bias,
        )  # fmt: skip
        weakref.finalize(self, extension.unregister_layer, self.handle)

    @classmethod
    def quantizing(cls, linear: nn.Linear, bits: int, kernel_rows: int | None) -> QuantizedLinear:
        """The layer for `linear`'s own weight quantized to `bits`."""
        weight = group_linear.pack(*group_linear.quantize(linear.weight.detach(), bits), bits)
        return cls(weight, linear.bias, kernel_rows, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`pagedserve::quantized_linear`, the C++ op, in eager steps and compiled graphs
        (over `x` in `order`, where set)."""
        if self.order is not None:
            x = x.index_select(-1, self.order)
        return torch.ops.pagedserve.quantized_linear(x, self.handle)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.dense is not None and rows > self.kernel_rows:
            return self.dense.compute(x)
        return self.kernel(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized kernel over any number of rows."""
        y = group_linear.group_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight the layer computes (W: its columns in its inputs'
        order, not the codes'), dequantized to fp32 `[len(ids), in_features]`."""
        rows = group_linear.unpack(self.weight, ids)
        return rows if self.order is None else rows[:, torch.argsort(self.order)]

    def extra_repr(self) -> str:
        rows = "all" if self.kernel_rows is None else f"<={self.kernel_rows}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.bits}-bit codes in groups of {group_linear.GROUP} "
            f"({SCHEME_NAMES[self.weight.scheme]}), kernel rows {rows}{self._order_repr()}"
        )

    def _order_repr(self) -> str:
        if self.order is None:
            return ""
        digest = hashlib.sha256(self.order.numpy().tobytes()).hexdigest()[:16]
        return f", inputs in order {digest}"


_op_loaded = False


def _load_op():
    """The kernel's extension, once it has defined `pagedserve::quantized_linear` (loading
    it registers the op) and the op has its fake and its dense fallback."""
    global _op_loaded
    extension = group_linear.EXTENSION.load()
    if not _op_loaded:
        torch.library.register_fake("pagedserve::quantized_linear")(fake_linear)
        torch.library.register_fake("pagedserve::quantized_linear_group")(fake_linear_group)
        extension.set_dense_fallback(opaque_linear)
        _op_loaded = True
    return extension


@torch.inference_mode()
def quantize_linear_layers(
    model: nn.Module, mode: str, kernel_rows: int | None, folder: Path | None = None
) -> int:
    """Replace every plain `nn.Linear` of `model` whose inputs come in whole groups by a
    `QuantizedLinear` of `mode`'s bits (the model's output embedding, its LM head, by one of
    `HEAD_BITS`), with `kernel_rows` (the engine passes `max_kernel_rows`; None runs the
    kernel at every row count); return how many. The quantized weights come from
    `quantized_store` (made once from `folder`'s fp32 weights, then loaded). Call only where
    `unavailable_reason` gives None for the model's device, dtype and `mode`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    linears = {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and group_linear.supports(module.in_features)
    }
    names = {id(linear): name for name, linear in linears.items()}
    # With a dense path (`kernel_rows` set), its copy is dequantized from the loaded
    # weight, so the kernel's codes come from that weight too (unsaved), not the file's.
    weights = quantized_store.packed_weights(
        linears,
        lambda name: HEAD_BITS if linears[name] is head else MODES[mode],
        mode,
        folder if kernel_rows is None else None,
    )

    def quantized(linear: nn.Linear) -> nn.Module:
        if id(linear) not in names:
            return linear
        weight = weights[names[id(linear)]]
        return QuantizedLinear(weight, linear.bias, kernel_rows, linear.weight.dtype)

    return replace_linear_layers(model, quantized)
