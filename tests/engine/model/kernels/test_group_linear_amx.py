"""The kernel's AMX-INT8 path (calls of `amx_min_rows` rows or more, in blocks of 16 rows)
gives the very bits of its AVX512-VNNI path and of the stated arithmetic's scalar code: the
per-group integer sums are exact in both and the fp32 epilogue is the same operations in
the same order, so a row's bits do not depend on the path its call took."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels import group_linear


def _extension():
    reason = group_linear.EXTENSION.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the C++ kernel cannot be built here: {reason}")
    extension = group_linear.EXTENSION.load()
    if not extension.amx_available():
        pytest.skip(
            "no AMX-INT8 path: the build lacks __AMX_TILE__/__AMX_INT8__ (-march=native "
            "on a CPU without AMX) or Linux refused this process the tile data"
        )
    return extension


@pytest.fixture
def amx():
    """The extension, with AMX switched back on whatever a test did."""
    extension = _extension()
    yield extension
    extension.set_amx(True)


def both_paths(extension, x, packed, bias):
    extension.set_amx(True)
    with_amx = group_linear.group_linear(x, packed, bias)
    extension.set_amx(False)
    without = group_linear.group_linear(x, packed, bias)
    extension.set_amx(True)
    return with_amx, without


def scalar_reference(x, codes, scales, offsets, bias):
    """The header's "Arithmetic" in scalar-order torch fp32: x quantized per group of 32,
    exact integer sums, then per group fma(isum, scale * xs, acc) and fma(offset, xsum, acc)
    in order (xsum: the codes' sum times xs), the bias added, rounded once to x's dtype. An
    fp32 fma is emulated in float64: its products are exact there (at most 45 significant
    bits) and the sum rounds twice (to float64, then fp32), which matches a single rounding
    except in rare ties, none in these seeded inputs."""
    rows, k = x.shape
    groups = k // 32
    values = x.float().reshape(rows, groups, 32)
    amax = values.abs().amax(dim=2)
    levels = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (not a reciprocal)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    xq = torch.round(values * inverse[..., None])  # rounds half to even, as nearbyint
    xs = amax / levels
    xsum = xq.sum(dim=2) * xs  # the codes' integer sum (exact in fp32), times their scale
    isum = torch.einsum("mgi,ngi->mng", xq.double(), codes.double().reshape(-1, groups, 32))
    acc = torch.zeros(rows, codes.shape[0])
    for g in range(groups):
        step = scales.float()[None, :, g] * xs[:, None, g]  # fp32 product
        acc = (isum[:, :, g] * step.double() + acc.double()).float()  # one rounding: fma
        acc = (offsets.double()[None, :, g] * xsum.double()[:, None, g] + acc.double()).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


@pytest.mark.parametrize("bits", group_linear.BITS)
@pytest.mark.parametrize("k", [576, 1536])
@pytest.mark.parametrize("n", [192, 576, 1000])  # 1000: a last tile of 8 outputs
def test_amx_gives_the_vnni_paths_bits(amx, bits: int, k: int, n: int):
    torch.manual_seed(k + n + bits)
    codes, scales, offsets = group_linear.quantize(torch.randn(n, k), bits)
    packed = group_linear.pack(codes, scales, offsets, bits)
    bias = torch.randn(n)
    x = torch.randn(1024, k) * torch.logspace(-2, 2, 1024)[:, None]
    x[5, :64] = 0  # groups of zeros: scale 0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for m in (16, 17, 31, 64, 100, 1024):
            for b in (None, bias):
                with_amx, without = both_paths(amx, xd[:m], packed, b)
                assert with_amx.dtype == dtype and with_amx.shape == (m, n)
                assert torch.equal(with_amx, without), (m, dtype, b is None)
        # The scalar-order reference, on a few rows (it is slow in Python).
        rows = torch.tensor([0, 5, 17, 700, 1023])
        expected = scalar_reference(xd[rows], codes, scales, offsets, bias)
        assert torch.equal(group_linear.group_linear(xd, packed, bias)[rows], expected)


@pytest.mark.parametrize("bits", group_linear.BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_alone_and_in_a_1024_row_call_has_the_same_bits(amx, bits: int, dtype):
    torch.manual_seed(bits)
    n, k = 200, 576
    packed = group_linear.pack(*group_linear.quantize(torch.randn(n, k), bits), bits)
    bias = torch.randn(n)
    x = torch.randn(1024, k).to(dtype)
    assert 1024 >= amx.amx_min_rows > 1
    together = group_linear.group_linear(x, packed, bias)  # AMX, blocks of 16 rows
    for row in (0, 15, 16, 511, 1000, 1023):
        alone = group_linear.group_linear(x[row : row + 1], packed, bias)  # VNNI, 1 row
        assert torch.equal(alone[0], together[row]), row


def test_amx_can_be_switched_off_and_on(amx):
    assert amx.instruction_set == "avx512-vnni"
    amx.set_amx(False)
    assert amx.amx_available()  # availability is the machine's, not the switch's
    amx.set_amx(True)
