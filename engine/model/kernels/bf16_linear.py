"""The C++ row-invariant bf16 linear kernel (`bf16_linear.cpp`) and its weight layout.

`pack` lays a bf16 weight `[N, K]` out as the kernel reads it, `bf16_linear` runs the
kernel. It exists where the CPU has AVX512-BF16 (`unavailable_reason` says why not
elsewhere); each output element is summed in one order fixed by the layer, so a row's
bits never depend on how many rows run with it (see the source's header).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.kernels.cpp_extension import CppExtension, cpu_flags

EXTENSION = CppExtension("bf16_linear", Path(__file__).with_name("bf16_linear.cpp"))
TILE = 16  # outputs per tile of the packed layout


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None if it can (builds it on first call where the
    CPU has AVX512-BF16; a CPU without is refused before any build)."""
    if "avx512_bf16" not in cpu_flags().split():
        return "the CPU has no AVX512-BF16"
    return EXTENSION.unavailable_reason()


def runs_on_amx() -> bool:
    """Whether the kernel computes here on AMX tiles (AMX-BF16, granted by Linux), where it
    outruns oneDNN's fp32 (docs/embeddings.md); builds it where the CPU has AVX512-BF16."""
    return unavailable_reason() is None and bool(EXTENSION.load().amx_available())


def supports(in_features: int) -> bool:
    """Whether a linear with `in_features` inputs fits the kernel (input pairs)."""
    return in_features % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` (bf16, K even) as `[tiles, K / 2, TILE, 2]`: per tile of TILE
    outputs, each pair of inputs of its outputs side by side (the last tile padded)."""
    n, k = weight.shape
    tiles = -(-n // TILE)
    padded = torch.cat([weight, weight.new_zeros(tiles * TILE - n, k)])
    return padded.reshape(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [..., K] @ W^T (+ bias) -> [..., N]` in bf16 for `packed = pack(W)`. Raises
    `KernelUnavailableError` if the kernel cannot be built here."""
    return EXTENSION.load().bf16_linear(x, packed, out_features, bias)
