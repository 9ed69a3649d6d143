"""GGML's block types read into the group kernel's formats, with no value changed.

`to_packed(ggml_type, blocks)` takes a GGUF tensor's rows as stored (`[rows, bytes per
row]`, uint8) and returns the `PackedWeight` that holds the very same weights
(`group_linear.unpack` of it equals gguf's `dequantize` of the blocks, bit for bit;
tests/engine/model/test_gguf.py checks each type). The layouts are GGML's
(`ggml-common.h`; gguf-py's `quants.py` reads them the same way):

| type | bytes per block of weights | weight | kernel format |
|---|---|---|---|
| Q4_0 | 18 per 32: d, 16 bytes of nibbles | d (q - 8) | affine 4-bit, offset -8d |
| Q4_1 | 20 per 32: d, m, nibbles | d q + m | affine 4-bit |
| Q5_0 | 22 per 32: d, 32 fifth bits, nibbles | d (q - 16) | affine 5-bit, offset -16d |
| Q5_1 | 24 per 32: d, m, fifth bits, nibbles | d q + m | affine 5-bit |
| Q8_0 | 34 per 32: d, 32 int8 | d q | affine 8-bit, code q + 128, offset -128d |
| IQ4_NL | 18 per 32: d, nibbles into 16 values v | d v[q] | affine 8-bit, v[q] + 128, -128d |
| Q4_K | 144 per 256: d, dmin, 6-bit scales, mins per 32, nibbles | d sc q - dmin m | super-min, 4 |
| Q5_K | 176 per 256: as Q4_K plus fifth bits | d sc q - dmin m | super-min, 5 |
| Q6_K | 210 per 256: nibbles, 2-bit highs, int8 scales per 16, d | d sc (q-32) | super-signed, 6 |

The offsets -8d, -16d and -128d are exact in fp16 (a power of two times d). IQ4_NL's values
(`IQ4_NL.kvalues`, -127 to 113) take 8-bit codes: exact, at 8 bits a weight rather than
4.5. Nibbles: in a 32-weight block, byte i holds weight i (low) and weight i + 16 (high);
Q4_K and Q5_K's 128 bytes hold sub-blocks 2p and 2p + 1 in the low and high nibbles of
bytes 32p..32p + 31.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import IQ4_NL, Q4_K

from engine.model.kernels import group_linear
from engine.model.kernels.group_linear import AFFINE, SUPER_MIN, SUPER_SIGNED, PackedWeight

# Bytes per block and weights per block of each type the kernel computes exactly, and the
# kernel format (bits, scheme) that holds it.
BLOCKS = {
    "Q4_0": (18, 32, 4, AFFINE),
    "Q4_1": (20, 32, 4, AFFINE),
    "Q5_0": (22, 32, 5, AFFINE),
    "Q5_1": (24, 32, 5, AFFINE),
    "Q8_0": (34, 32, 8, AFFINE),
    "IQ4_NL": (18, 32, 8, AFFINE),
    "Q4_K": (144, 256, 4, SUPER_MIN),
    "Q5_K": (176, 256, 5, SUPER_MIN),
    "Q6_K": (210, 256, 6, SUPER_SIGNED),
}


_IQ4_NL_CODES = (np.array(IQ4_NL.kvalues) + 128).astype(np.uint8)


def _half(data: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block (`data [..., block bytes]`)."""
    return np.ascontiguousarray(data[..., at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: byte i's low nibble is code i, its high i + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits: bit i is code i's fifth."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _affine(ggml_type: str, data: np.ndarray):
    """codes [rows, blocks, 32], scale and offset [rows, blocks] (fp16), bits."""
    d = _half(data, 0)
    if ggml_type == "Q8_0":
        return data[..., 2:] ^ 0x80, d, _exact(d, -128), 8
    if ggml_type == "IQ4_NL":
        return _IQ4_NL_CODES[_nibbles(data[..., 2:])], d, _exact(d, -128), 8
    if ggml_type == "Q4_0":
        return _nibbles(data[..., 2:]), d, _exact(d, -8), 4
    if ggml_type == "Q4_1":
        return _nibbles(data[..., 4:]), d, _half(data, 2), 4
    if ggml_type == "Q5_0":
        return _nibbles(data[..., 6:]) | _fifth_bits(data[..., 2:6]), d, _exact(d, -16), 5
    return _nibbles(data[..., 8:]) | _fifth_bits(data[..., 4:8]), d, _half(data, 2), 5  # Q5_1


def _exact(d: np.ndarray, factor: int) -> np.ndarray:
    """`factor * d` in fp16, exact (a power of two times d) or refused beyond its range."""
    product = d.astype(np.float32) * factor
    if not np.isfinite(product.astype(np.float16)).all():
        raise ValueError(f"a block's offset {factor} d is beyond fp16's range")
    return product.astype(np.float16)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K and Q5_K's [..., 128] bytes -> [..., 8 sub-blocks, 32] codes."""
    pairs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([pairs & 0x0F, pairs >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _super(ggml_type: str, data: np.ndarray):
    """codes [rows, blocks, 256], d [rows, blocks], dmin [rows, blocks] or None, sub
    ([rows, blocks, 8, 2] uint8 or [rows, blocks, 16] int8), bits, scheme."""
    if ggml_type == "Q6_K":
        ql, qh = data[..., :128], data[..., 128:192]
        scales = np.ascontiguousarray(data[..., 192:208]).view(np.int8)
        d = _half(data, 208)
        halves = []
        for h in range(2):  # weights 128h + r: ql byte 64h + r % 64, qh byte 32h + r % 32
            low = ql[..., 64 * h : 64 * h + 64]
            high = qh[..., 32 * h : 32 * h + 32]
            nibble = np.concatenate([low & 0x0F, low >> 4], axis=-1)
            twos = np.concatenate([(high >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
            halves.append(nibble | (twos << 4))
        return np.concatenate(halves, axis=-1), d, None, scales, 6, SUPER_SIGNED
    d, dmin = _half(data, 0), _half(data, 2)
    rows, blocks = data.shape[:2]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(data[..., 4:16]).reshape(-1, 12))
    sub = np.stack([sc, m], axis=-1).reshape(rows, blocks, 8, 2).astype(np.uint8)
    if ggml_type == "Q4_K":
        codes = _k_nibbles(data[..., 16:144])
        bits = 4
    else:  # Q5_K: bit j of qh[e] is sub-block j's element e's fifth bit
        qh = data[..., 16:48]
        fifth = np.stack([(qh >> j) & 1 for j in range(8)], axis=-2) << 4
        codes = _k_nibbles(data[..., 48:176]) | fifth
        bits = 5
    return codes.reshape(rows, blocks, 256), d, dmin, sub, bits, SUPER_MIN


def to_packed(ggml_type: str, blocks: np.ndarray) -> PackedWeight:
    """The weight whose rows are `blocks [rows, bytes per row]` of `ggml_type` (one of
    `BLOCKS`), packed for the kernel (see the module docstring)."""
    block_bytes, per_block, _, _ = BLOCKS[ggml_type]
    rows = blocks.shape[0]
    data = np.asarray(blocks, dtype=np.uint8).reshape(rows, -1, block_bytes)
    k = data.shape[1] * per_block
    if per_block == 32:
        codes, scale, offset, bits = _affine(ggml_type, data)
        return group_linear.pack(
            _tensor(codes).reshape(rows, k), _tensor(scale), _tensor(offset), bits, AFFINE
        )
    codes, d, dmin, sub, bits, scheme = _super(ggml_type, data)
    small = (
        _tensor(sub).reshape(rows, -1, 2) if scheme == SUPER_MIN else _tensor(sub).reshape(rows, -1)
    )
    return group_linear.pack(
        _tensor(codes).reshape(rows, k), _tensor(d), None if dmin is None else _tensor(dmin),
        bits, scheme, small,
    )  # fmt: skip


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))
