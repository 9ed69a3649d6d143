"""The C++ group-quantized linear kernel (`group_linear.cpp`) and its weight formats.

A weight `W [N, K]` is stored as unsigned codes of `bits` (4, 5, 6 or 8) per group of
`GROUP` inputs, in tiles of `TILE` outputs, under one of three schemes (the layouts in
`group_formats.h`):

- `AFFINE`: an fp16 scale and offset per group, `W = scale * code + offset`: llama.cpp's
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL exactly, and pagedserve's own int4/int8 (`quantize`:
  each group's minimum and maximum are codes 0 and 2^bits - 1; 4 bits is Q4_1).
- `SUPER_MIN`: an fp16 `d` and `dmin` per `SUPER` inputs, a 6-bit scale and minimum per
  group: `W = d * sc * code - dmin * m`: Q4_K (4 bits) and Q5_K (5 bits).
- `SUPER_SIGNED`: an fp16 `d` per `SUPER` inputs and a signed 8-bit scale per 16:
  `W = d * sc * (code - 32)`: Q6_K (6 bits).

`pack` lays codes and scales out for the kernel, `group_linear` runs it, `unpack` reads
rows back in fp32 exactly as GGML's own dequantization does. Scales and offsets are fp16,
as GGUF stores them (a scale beyond fp16's range, 65504, is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.kernels.cpp_extension import CppExtension

EXTENSION = CppExtension("group_linear", Path(__file__).with_name("group_linear.cpp"))
GROUP = 32  # inputs per code group
SUPER = 256  # inputs per super-block's d
TILE = 16  # outputs per tile of the packed layout
BITS = (8, 4)  # pagedserve's own modes
AFFINE, SUPER_MIN, SUPER_SIGNED = 0, 1, 2
_EMPTY = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class PackedWeight:
    """A quantized `[out_features, in_features]` weight in the kernel's layout: codes
    `uint8 [tiles, K / GROUP, 64 * bits]`; `scales` (and `offsets`) fp16 `[tiles, rows, TILE]`
    (rows: K / GROUP for AFFINE, K / SUPER otherwise; SUPER_SIGNED has no offsets); `sub`,
    the small scales, `uint8` (empty for AFFINE)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    out_features: int
    scheme: int = AFFINE
    sub: torch.Tensor = _EMPTY

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.offsets, self.sub))


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
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    scheme: int = AFFINE,
    sub: torch.Tensor | None = None,
) -> PackedWeight:
    """Lay codes `[N, K]` (uint8, below 2^bits) and their scales out in tiles of `TILE`
    outputs (the last tile padded): `scales` and `offsets` `[N, rows]` fp16 (rows as in
    `PackedWeight`; `offsets` None for SUPER_SIGNED), `sub` `[N, K / GROUP, 2]` uint8 (the
    6-bit scale and minimum of each group, SUPER_MIN) or `[N, K / 16]` int8 (SUPER_SIGNED)."""
    n, k = codes.shape
    tiles = -(-n // TILE)
    pad = tiles * TILE - n

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])]) if pad else tensor

    # [tiles, K / 32, 8 code vectors, 16 outputs, 4 inputs]
    c = padded(codes).reshape(tiles, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 8:
        parts = [c]
    else:
        parts = [(c[:, :, 0::2] & 0x0F) | ((c[:, :, 1::2] & 0x0F) << 4)]
        if bits == 5:
            plane = sum(((c[:, :, v] >> 4) & 1) << v for v in range(8))
            parts.append(plane)
        elif bits == 6:
            for p in range(2):
                parts.append(sum(((c[:, :, 4 * p + u] >> 4) & 3) << (2 * u) for u in range(4)))
    tiled = torch.cat([part.reshape(tiles, k // GROUP, -1) for part in parts], dim=2)

    def by_tile(values: torch.Tensor) -> torch.Tensor:
        values = padded(values).reshape(tiles, TILE, -1)
        return values.permute(0, 2, 1).contiguous()

    if scheme == SUPER_MIN:
        assert sub is not None
        small = padded(sub).reshape(tiles, TILE, k // GROUP, 2).permute(0, 2, 3, 1)
    elif scheme == SUPER_SIGNED:
        assert sub is not None
        small = by_tile(sub.view(torch.uint8))
    else:
        small = _EMPTY
    return PackedWeight(
        tiled.to(torch.uint8).contiguous(),
        by_tile(scales),
        by_tile(offsets) if offsets is not None else torch.empty(0, dtype=torch.float16),
        bits,
        n,
        scheme,
        small.contiguous(),
    )


def group_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [M, K] @ W^T (+ bias) -> [M, N]` on the CPU, x fp32 or bf16, the result in x's
    dtype (computed in fp32, the bias added, rounded once). Each row of x is quantized to
    int8 per group of `GROUP` (see the source's "Arithmetic"); a row's bits depend only on
    that row and the weight. Raises `KernelUnavailableError` if the kernel cannot be built
    here."""
    return EXTENSION.load().group_linear(x, *_arrays(weight), weight.out_features, bias)


def unpack(weight: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `rows` (default: all) of the weight in fp32 `[len(rows), K]`: for a GGUF's
    blocks, GGML's own dequantization, bit for bit."""
    if rows is None:
        rows = torch.arange(weight.out_features)
    return EXTENSION.load().dequantize(
        *_arrays(weight), weight.in_features, weight.out_features, rows.long()
    )


def _arrays(weight: PackedWeight) -> tuple:
    """The arguments the extension takes for a weight, up to `n`."""
    return (weight.codes, weight.scales, weight.offsets, weight.sub, weight.bits, weight.scheme)
