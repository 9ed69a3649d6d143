"""Linears that share an input run as one call, with the same bits: the quantized group op
against separate calls (the bf16 one's is in test_bf16_linear.py), and the compiled graph's
pass that makes the groups, for both kernels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.linears.bf16_linear import Bf16Linear
from engine.linears.linear_groups import GroupSharedInputs
from engine.linears.quantized_linear import QuantizedLinear, unavailable_reason
from engine.model.kernels import bf16_linear

CPU = torch.device("cpu")
DTYPES = [d for d in (torch.float32, torch.bfloat16) if unavailable_reason(CPU, d, "int4") is None]
requires_quantized_kernel = pytest.mark.skipif(
    not DTYPES, reason="the C++ kernel cannot be built here"
)


def layers(dtype: torch.dtype, bias: bool, kernel_rows: int | None = None):
    """q, k, v-like layers over 64 inputs (k and v with a partial last tile), 4 and 8 bits."""
    torch.manual_seed(0)
    shapes = [(64, 4), (40, 4), (40, 8)]
    return [
        QuantizedLinear.quantizing(nn.Linear(64, n, bias=bias, dtype=dtype), bits, kernel_rows)
        for n, bits in shapes
    ]


@requires_quantized_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])  # 17 and 40: AMX blocks where available
def test_a_group_call_gives_each_layers_bits(dtype, bias, rows) -> None:
    group = layers(dtype, bias)
    x = torch.randn(2, rows, 64, dtype=dtype)
    got = torch.ops.pagedserve.quantized_linear_group(x, [layer.handle for layer in group])
    expected = torch.cat([layer(x) for layer in group], dim=-1)
    assert got.shape == (2, rows, 144) and torch.equal(got, expected)


@requires_quantized_kernel
def test_layers_with_a_row_threshold_run_one_by_one_above_it() -> None:
    group = layers(DTYPES[0], bias=False, kernel_rows=2)
    x = torch.randn(5, 64, dtype=DTYPES[0])
    got = torch.ops.pagedserve.quantized_linear_group(x, [layer.handle for layer in group])
    assert torch.equal(got, torch.cat([layer(x) for layer in group], dim=-1))


class SharedInput(nn.Module):
    """Three projections of one input and one of another, as an attention block has."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module, o: nn.Module) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x, (64,))
        kv = torch.cat([self.k(h) * 2, self.v(h)], dim=-1)
        return self.o(self.q(h) + kv[..., :64]) + x


def quantized_module() -> tuple[SharedInput, torch.dtype]:
    dtype = DTYPES[0]
    o = QuantizedLinear.quantizing(nn.Linear(64, 64, dtype=dtype), 4, None)
    return SharedInput(*layers(dtype, bias=True), o), dtype


def bf16_module() -> tuple[SharedInput, torch.dtype]:
    torch.manual_seed(0)
    q, k, v, o = (Bf16Linear(nn.Linear(64, n, dtype=torch.bfloat16)) for n in (64, 40, 40, 64))
    return SharedInput(q, k, v, o), torch.bfloat16


@pytest.mark.parametrize(
    ("build", "op"),
    [
        pytest.param(quantized_module, "quantized_linear", marks=requires_quantized_kernel),
        pytest.param(
            bf16_module,
            "bf16_linear",
            marks=pytest.mark.skipif(
                bf16_linear.unavailable_reason() is not None, reason="no bf16 kernel here"
            ),
        ),
    ],
    ids=["quantized", "bf16"],
)
def test_the_compiled_pass_merges_calls_that_share_an_input(build, op: str) -> None:
    module, dtype = build()
    x = torch.randn(3, 64, dtype=dtype)
    options = {"cpp_wrapper": True}
    plain = torch.compile(module, fullgraph=True, options=options)
    grouped = torch.compile(
        module, fullgraph=True, options=options | {"post_grad_custom_pre_pass": GroupSharedInputs()}
    )
    with torch.inference_mode():
        expected = plain(x)
        grouped(x)  # compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = grouped(x)
    calls = [event.name for event in prof.events() if event.name.startswith("pagedserve::")]
    assert sorted(calls) == [f"pagedserve::{op}", f"pagedserve::{op}_group"]
    assert torch.equal(got, expected)
