"""The C++ group-quantized linear kernel (`group_linear.cpp`) and its weight format.

A weight `W [N, K]` is stored as unsigned codes of `bits` (8 or 4) with a scale and an
offset per group of `GROUP` inputs of a row: `W[n, k] = scales[n, g] * codes[n, k] +
offsets[n, g]`, `g = k // GROUP`. With 4 bits this is llama.cpp's Q4_1. `quantize` makes
the codes from a weight (each group's minimum and maximum are codes 0 and 2^bits - 1),
`pack` lays them out for the kernel, `group_linear` runs it.

Scales and offsets are fp16, as GGUF stores them (a scale below fp16's normal range,
6.1e-5, keeps fewer significant bits; one beyond its range, 65504, is refused):
re-quantizing a weight that was converted from a Q4_1 GGUF (the default model's linears)
to 4 bits gives back its very codes, scales and offsets, so the quantized model computes
the file's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.kernels.cpp_extension import CppExtension

EXTENSION = CppExtension("group_linear", Path(__file__).with_name("group_linear.cpp"))
GROUP = 32  # inputs per scale group
TILE = 16  # outputs per tile of the packed layout
BITS = (8, 4)


@dataclass(frozen=True)
class PackedWeight:
    """A quantized `[out_features, in_features]` weight in the kernel's layout (see the
    source): codes `uint8`, scales and offsets fp16 `[tiles, in_features // GROUP, TILE]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    out_features: int


def supports(in_features: int) -> bool:
    """Whether a linear with `in_features` inputs can be quantized in groups."""
    return in_features % GROUP == 0


def _to_fp16(values: torch.Tensor, what: str) -> torch.Tensor:
    rounded = values.half()
    if not bool(torch.isfinite(rounded).all()):
        raise ValueError(f"a weight group's {what} is beyond fp16's range (65504)")
    return rounded


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(codes [N, K] uint8, scales [N, K // GROUP], offsets [N, K // GROUP])` (fp16) of
    `weight [N, K]` with `K % GROUP == 0`: per group, offset = the minimum, scale = the
    range over 2^bits - 1, each code the nearest step."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, not {bits}")
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    levels = 2**bits - 1
    scales = _to_fp16((high - low) / levels, "scale")
    offsets = _to_fp16(low, "minimum")
    step = torch.where(scales > 0, scales, torch.ones_like(scales)).float()
    codes = torch.round((groups - offsets.float()[..., None]) / step[..., None]).clamp(0, levels)
    codes = torch.where(scales[..., None] > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.uint8).reshape(n, k), scales, offsets


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The fp32 weight `[N, K]` that `quantize`'s output stands for."""
    n, k = codes.shape
    groups = codes.float().reshape(n, k // GROUP, GROUP)
    return (groups * scales.float()[..., None] + offsets.float()[..., None]).reshape(n, k)


def pack(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int
) -> PackedWeight:
    """Lay `quantize`'s output out in tiles of `TILE` outputs (the last tile padded)."""
    n, k = codes.shape
    tiles = -(-n // TILE)
    pad = tiles * TILE - n

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros(pad, tensor.shape[1])])

    codes, scales, offsets = padded(codes), padded(scales), padded(offsets)
    if bits == 8:  # [tiles, K / 4, TILE, 4]
        tiled = codes.reshape(tiles, TILE, k // 4, 4).permute(0, 2, 1, 3)
    else:  # [tiles, K / 8, TILE, 4]: low nibbles inputs 8j..8j+3, high nibbles 8j+4..8j+7
        halves = codes.reshape(tiles, TILE, k // 8, 2, 4)
        tiled = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 1, 3)

    def by_tile(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(tiles, TILE, k // GROUP).permute(0, 2, 1).contiguous()

    return PackedWeight(tiled.contiguous(), by_tile(scales), by_tile(offsets), bits, n)


def group_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [M, K] @ W^T (+ bias) -> [M, N]` on the CPU, x fp32 or bf16, the result in x's
    dtype (computed in fp32, the bias added, rounded once). Each row of x is quantized to
    int8 per group of `GROUP` (see the source's "Arithmetic"); a row's bits depend only on
    that row and the weight. Raises `KernelUnavailableError` if the kernel cannot be built
    here."""
    return EXTENSION.load().group_linear(
        x, weight.codes, weight.scales, weight.offsets, weight.bits, weight.out_features, bias
    )
