"""The row-invariant bf16 kernel and its layer: close to the exact product, the op and the
layer agree, the engine packs bf16 linears with it where it runs, and both of the
kernel's instruction sets keep a row's bits whatever runs with it (their row-invariance
checks are in test_packed_linear.py, with every layer the engine packs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine.linears.bf16_linear import Bf16Linear, runs_kernel
from engine.linears.packed_linear import PackedLinear, can_pack, pack_linear_layers
from engine.model.kernels import bf16_linear

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    bf16_linear.unavailable_reason() is not None,
    reason=f"the bf16 kernel cannot run here: {bf16_linear.unavailable_reason()}",
)
# AMX where this CPU has it, and the AVX512-BF16 code, which runs everywhere else.
INSTRUCTION_SETS = ["amx", "avx512-bf16"]


@pytest.fixture(params=INSTRUCTION_SETS)
def instruction_set(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one of the kernel's instruction sets, then restore the default."""
    extension = bf16_linear.EXTENSION.load()
    if request.param == "amx" and not extension.amx_available():
        pytest.skip("no AMX-BF16 here")
    extension.set_amx(request.param == "amx")
    yield request.param
    extension.set_amx(True)


def exact_and_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact `x W^T + b` (fp64 of the bf16 values) and the largest error a bf16 result
    of fp32 sums may have: half a bf16 step of the result (its final rounding) plus K fp32
    roundings of the magnitudes summed (any order of summation)."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (bias.double() if bias is not None else 0)
    magnitudes = x64.abs() @ w64.abs().T + (bias.double().abs() if bias is not None else 0)
    k = x.shape[-1]
    return exact, 2.0**-8 * exact.abs() + 2 * k * 2.0**-24 * magnitudes


@pytest.mark.parametrize(("in_features", "out_features"), [(64, 40), (96, 160), (34, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_as_close_to_the_exact_product_as_bf16_allows(
    instruction_set: str, in_features: int, out_features: int, bias: bool
) -> None:
    """Not bit-equal to `F.linear` (oneDNN sums in another order): within the error bound of
    a bf16 result of fp32 sums, over every row count to 40 (AMX blocks and the padded last
    block), with a partial last tile of outputs and K that is not a multiple of 32."""
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    packed = bf16_linear.pack(linear.weight.detach())
    x = torch.randn(40, in_features).bfloat16()
    with torch.inference_mode():
        got = bf16_linear.bf16_linear(x, packed, out_features, linear.bias)
    exact, bound = exact_and_bound(x, linear.weight, linear.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (40, out_features)
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_the_layer_and_its_op_agree_in_any_shape(instruction_set: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, dtype=torch.bfloat16)
    layer = Bf16Linear(linear)
    with torch.inference_mode():
        for x in (torch.randn(64), torch.randn(1, 64), torch.randn(2, 5, 64)):
            x = x.bfloat16()
            out = layer(x)  # the registered op
            assert out.shape == (*x.shape[:-1], 48) and out.is_contiguous()
            assert torch.equal(out, layer.compute(x))
            rows = x.reshape(-1, 64)
            assert torch.equal(out.reshape(-1, 48), layer.compute(rows))


def test_the_op_refuses_what_it_cannot_compute() -> None:
    layer = Bf16Linear(nn.Linear(64, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        layer(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="last axis must be K = 64"):
        layer(torch.randn(2, 32).bfloat16())


def test_a_group_call_gives_each_layers_bits(instruction_set: str) -> None:
    torch.manual_seed(0)
    group = [Bf16Linear(nn.Linear(64, n, dtype=torch.bfloat16)) for n in (64, 40, 40)]
    x = torch.randn(2, 17, 64).bfloat16()
    with torch.inference_mode():
        got = torch.ops.pagedserve.bf16_linear_group(x, [layer.handle for layer in group])
        expected = torch.cat([layer(x) for layer in group], dim=-1)
    assert got.shape == (2, 17, 144) and torch.equal(got, expected)


def test_the_engine_packs_bf16_linears_with_the_kernel_and_the_rest_with_onednn() -> None:
    if not can_pack(CPU, torch.bfloat16):
        pytest.skip("oneDNN cannot compute bf16 on this CPU")
    model = nn.Sequential(
        nn.Linear(64, 32, dtype=torch.bfloat16),
        nn.Linear(32, 33, dtype=torch.bfloat16),
        nn.Linear(33, 8, dtype=torch.bfloat16),  # an odd number of inputs: oneDNN
        nn.Linear(8, 8),  # fp32: oneDNN
    )
    assert pack_linear_layers(model) == 4
    assert [type(layer) for layer in model] == [Bf16Linear, Bf16Linear, PackedLinear, PackedLinear]
    assert not runs_kernel(nn.Linear(8, 8))
