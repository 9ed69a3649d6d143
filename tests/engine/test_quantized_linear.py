"""Weight-only int8 linears: close to their dequantized weights, row-invariant within each
path, switching paths at the row threshold, and served by the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig, load_config
from engine.model.packed_linear import can_pack
from engine.model.quantized_linear import (
    QuantizedLinear,
    dequantize_int8,
    max_kernel_rows,
    quantize_int8,
    quantize_linear_layers,
    unavailable_reason,
)
from server.cli import build_parser
from server.config import resolve_serve_config

CPU = torch.device("cpu")
DTYPES = [d for d in (torch.float32, torch.bfloat16) if unavailable_reason(CPU, d, "int8") is None]
pytestmark = pytest.mark.skipif(not DTYPES, reason="the C++ int8 kernel cannot be built here")
# The kernel computes in fp32 and rounds its result once: a bf16 output is within 2^-8.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
}


def random_linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False):
    torch.manual_seed(in_features + out_features)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def test_quantization_error_is_at_most_half_a_step():
    weight = random_linear(256, 192, torch.float32).weight.detach()
    codes, scales = quantize_int8(weight)
    assert codes.abs().max() == 127
    step = scales.float()[:, None]
    assert ((dequantize_int8(codes, scales) - weight).abs() <= step * 0.51).all()


# Input counts: whole vectors (576), an odd number of AVX2 vectors (200), and a scalar tail.
IN_FEATURES = pytest.mark.parametrize("in_features", [576, 200, 203])


@IN_FEATURES
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_computes_the_dequantized_weight(dtype: torch.dtype, in_features: int):
    linear = random_linear(in_features, 192, dtype, bias=True)
    layer = QuantizedLinear(linear, None)
    dequantized = dequantize_int8(*quantize_int8(linear.weight.detach()))
    x = torch.randn(2, 3, in_features).to(dtype)
    with torch.inference_mode():
        out = layer(x)
        expected = F.linear(x.float(), dequantized, linear.bias.float())
    assert out.shape == (2, 3, 192) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@IN_FEATURES
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_rows_do_not_depend_on_how_many_rows_run_with_them(
    dtype: torch.dtype, in_features: int
):
    layer = QuantizedLinear(random_linear(in_features, 192, dtype), None)
    x = torch.randn(40, in_features).to(dtype)
    with torch.inference_mode():
        reference = layer.kernel(x)
        for rows in range(1, 41):
            differing = (layer.kernel(x[:rows]) != reference[:rows]).any(dim=1).sum().item()
            assert differing == 0, f"{differing} of {rows} rows differ"


def test_the_layer_switches_to_the_dense_path_above_its_row_threshold():
    rows = max_kernel_rows(torch.float32)
    assert rows is not None
    layer = QuantizedLinear(random_linear(128, 64, torch.float32, bias=True), rows)
    with torch.inference_mode():
        small, large = torch.randn(1, rows, 128), torch.randn(rows + 1, 128)
        assert torch.equal(layer(small), layer.kernel(small))
        assert torch.equal(layer(large), layer.dense(large))
        # Both paths compute the same quantized weights, in sums of different orders.
        torch.testing.assert_close(layer.kernel(large), layer.dense(large))


def test_every_plain_linear_is_quantized():
    model = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 7))
    assert quantize_linear_layers(model, "int8", None) == 2
    assert all(isinstance(layer, QuantizedLinear) for layer in model)
    assert model(torch.randn(3, 64)).shape == (3, 7)


def test_bf16_keeps_a_dense_copy_only_where_onednn_packs_it():
    rows = max_kernel_rows(torch.bfloat16)
    assert (rows is None) == (not can_pack(CPU, torch.bfloat16))
    layer = QuantizedLinear(random_linear(128, 64, torch.bfloat16), rows)
    assert (layer.dense is None) == (rows is None)


def test_quantization_runs_only_on_the_cpu_in_fp32_and_bf16():
    assert "CPU only" in unavailable_reason(torch.device("cuda"), torch.float32, "int8")
    assert "float32 or bfloat16" in unavailable_reason(CPU, torch.float16, "int8")
    assert "unknown mode 'int4'" in unavailable_reason(CPU, torch.float32, "int4")


def test_quantization_on_cuda_or_in_fp16_is_a_config_error(tiny_model_paths: dict[str, Path]):
    with pytest.raises(ConfigError, match="CPU only"):
        load_config(EngineConfig, overrides={"device": "cuda", "quantization": "int8"}, environ={})
    with pytest.raises(ConfigError, match=r"quantization 'int8' cannot run .*float32 or bfloat16"):
        LLM(str(tiny_model_paths["llama"]), dtype="float16", quantization="int8")


def test_the_server_takes_quantization_from_flags_and_the_environment():
    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    config = resolve_serve_config(None, {"quantization": args.quantization}, {})
    assert config.engine_config().quantization == "int8"
    config = resolve_serve_config(None, {}, {"PAGEDSERVE_QUANTIZATION": "int8"})
    assert config.engine_config().quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int4"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_engine_serves_a_quantized_model_alike_alone_and_batched(
    tiny_model_paths: dict[str, Path], dtype: torch.dtype
):
    """Prompts of more rows than the threshold prefill on the dense path, alone or together,
    and three sequences decode on the kernel path alone or together: both row-invariant."""
    name = str(dtype).removeprefix("torch.")
    llm = LLM(
        str(tiny_model_paths["llama"]), dtype=name, quantization="int8", kv_cache_memory="16MiB"
    )
    assert any(isinstance(m, QuantizedLinear) for m in llm.engine.model.modules())
    assert not any(type(m) is nn.Linear for m in llm.engine.model.modules())
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    threshold = max_kernel_rows(dtype) or 0  # None: the kernel at every row count
    prompts = [list(range(5, 5 + threshold + n)) for n in (2, 5, 8)]
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    for one, batched in zip(alone, together, strict=True):
        assert len(batched.outputs[0].token_ids) == 10
        assert one.outputs[0].token_ids == batched.outputs[0].token_ids
        assert one.outputs[0].logprobs == batched.outputs[0].logprobs
    assert llm.engine.stats().used_kv_blocks == 0


@pytest.mark.slow
def test_the_quantized_default_model_still_knows_its_capitals():
    llm = LLM("default", quantization="int8", kv_cache_memory="32MiB", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    output = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    assert llm.engine.stats().used_kv_blocks == 0
