"""Group-quantized linears: the format reproduces Q4_1 weights, the kernel computes its
stated arithmetic, rows are invariant within each path, paths switch at the row threshold,
and the engine serves both modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from torch import nn

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig, load_config
from engine.linears.ggml_blocks import to_packed
from engine.linears.packed_linear import can_pack
from engine.linears.quantized_linear import (
    HEAD_BITS,
    KERNEL_ROWS,
    MODES,
    QuantizedLinear,
    max_kernel_rows,
    quantize_linear_layers,
    unavailable_reason,
)
from engine.model import loader
from engine.model.kernels import group_linear
from pagedserve.cli import build_parser
from server.config import resolve_serve_config
from tests.support.gguf_files import KERNEL_TYPES, random_blocks

CPU = torch.device("cpu")
DTYPES = [d for d in (torch.float32, torch.bfloat16) if unavailable_reason(CPU, d, "int8") is None]
pytestmark = pytest.mark.skipif(not DTYPES, reason="the C++ kernel cannot be built here")
BITS = pytest.mark.parametrize("bits", group_linear.BITS)


def random_linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False):
    torch.manual_seed(in_features + out_features)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


@BITS
def test_quantization_error_is_at_most_half_a_step(bits: int):
    weight = random_linear(256, 192, torch.float32).weight.detach()
    codes, scales, offsets = group_linear.quantize(weight, bits)
    assert scales.dtype == offsets.dtype == torch.float16
    assert int(codes.max()) == 2**bits - 1 and int(codes.min()) == 0
    step = scales.float().repeat_interleave(group_linear.GROUP, dim=1)
    error = (group_linear.dequantize(codes, scales, offsets) - weight).abs()
    assert (error <= step * 0.51 + 1e-3 * step.max()).all()  # + the fp16 offsets' rounding


def test_requantizing_q4_1_weights_gives_them_back():
    """GGUF's Q4_1 blocks (fp16 scale d and minimum m per 32, w = d * q + m, with codes 0
    and 15 in every block) come back exactly: the default model's linears are such."""
    torch.manual_seed(0)
    n, k = 64, 256
    d = (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
    m = (-torch.rand(n, k // 32) * 0.1).half()
    q = torch.randint(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    weight = (d.float()[..., None] * q + m.float()[..., None]).reshape(n, k)
    codes, scales, offsets = group_linear.quantize(weight, 4)
    assert torch.equal(codes.reshape(n, k // 32, 32), q.to(torch.uint8))
    assert torch.equal(scales, d) and torch.equal(offsets, m)
    assert torch.equal(group_linear.dequantize(codes, scales, offsets), weight)


def stated_arithmetic(x: torch.Tensor, codes, scales, offsets) -> torch.Tensor:
    """The kernel's arithmetic (group_tiles_scalar.h) in float64: each group of 32 inputs
    quantized to int8 by its max |x| / 127, integer sums, then the scale against them and
    the offset against the codes' sum, both in the rounded inputs (as llama.cpp's Q8_1)."""
    rows, k = x.shape
    groups = x.double().reshape(rows, k // 32, 32)
    amax = groups.float().abs().amax(dim=2)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups.float() * inverse[..., None]).double()
    isum = torch.einsum("mgi,ngi->mng", xq, codes.double().reshape(-1, k // 32, 32))
    step = scales.double()[None] * (amax / 127.0).double()[:, None]
    xsum = xq.sum(dim=2) * (amax / 127.0).double()
    return (isum * step + offsets.double()[None] * xsum[:, None]).sum(dim=2)


@BITS
@pytest.mark.parametrize("out_features", [192, 50])  # whole tiles of 16, and a partial one
def test_the_kernel_computes_its_stated_arithmetic(bits: int, out_features: int):
    weight = random_linear(576, out_features, torch.float32).weight.detach()
    codes, scales, offsets = group_linear.quantize(weight, bits)
    packed = group_linear.pack(codes, scales, offsets, bits)
    x = torch.randn(7, 576)
    x[1, :32] = 0  # a group of zeros has scale 0
    out = group_linear.group_linear(x, packed)
    assert out.shape == (7, out_features) and out.dtype == torch.float32
    expected = stated_arithmetic(x, codes, scales, offsets)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # The inputs' quantization is a small error against the dequantized weight itself.
    dense = x @ group_linear.dequantize(codes, scales, offsets).T
    assert (out - dense).abs().max() < 0.03 * dense.abs().max()


@BITS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_layer_computes_the_kernel_in_its_dtype_with_bias(dtype: torch.dtype, bits: int):
    linear = random_linear(128, 48, dtype, bias=True)
    layer = QuantizedLinear.quantizing(linear, bits, None)
    x = torch.randn(2, 3, 128).to(dtype)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    # The C++ op and the layer's Python path: the fp32 result plus the bias, rounded once.
    fp32 = group_linear.group_linear(x.reshape(6, 128).float(), layer.weight) + linear.bias.float()
    assert torch.equal(out, fp32.to(dtype).reshape(2, 3, 48))
    assert torch.equal(out, layer.kernel(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_call_of_no_rows_gives_no_rows(dtype: torch.dtype):
    """A step whose chunks are all parts of prefills samples no row: its LM head runs on 0
    rows (the kernel once divided by zero there and killed the process with SIGFPE)."""
    layers = [QuantizedLinear.quantizing(random_linear(128, n, dtype), 4, None) for n in (48, 16)]
    x = torch.empty(1, 0, 128, dtype=dtype)
    with torch.inference_mode():
        assert layers[0](x).shape == (1, 0, 48)
        grouped = torch.ops.pagedserve.quantized_linear_group(x, [la.handle for la in layers])
    assert grouped.shape == (1, 0, 64)


@BITS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_rows_do_not_depend_on_how_many_rows_run_with_them(dtype: torch.dtype, bits: int):
    layer = QuantizedLinear.quantizing(random_linear(576, 200, dtype), bits, None)
    x = torch.randn(40, 576).to(dtype)
    with torch.inference_mode():
        reference = layer.kernel(x)
        for rows in range(1, 41):
            differing = (layer.kernel(x[:rows]) != reference[:rows]).any(dim=1).sum().item()
            assert differing == 0, f"{differing} of {rows} rows differ"
        for start in (3, 17):  # a row computed beside others, or in another run of 4
            assert torch.equal(layer.kernel(x[start : start + 5]), reference[start : start + 5])


def test_the_layer_switches_to_the_dense_path_above_its_row_threshold():
    rows = 16  # the scalar twin's fp32 threshold; with VNNI the kernel takes every count
    layer = QuantizedLinear.quantizing(random_linear(128, 64, torch.float32, bias=True), 4, rows)
    with torch.inference_mode():
        small, large = torch.randn(1, rows, 128), torch.randn(rows + 1, 128)
        assert torch.equal(layer(small), layer.kernel(small))
        assert torch.equal(layer(large), layer.dense(large))
        # Both paths compute the same weights; the kernel quantizes its inputs too.
        torch.testing.assert_close(layer.kernel(large), layer.dense(large), rtol=0.05, atol=0.05)


def test_an_input_order_computes_the_weight_whose_columns_the_codes_hold_permuted():
    """A weight whose codes hold its columns in another order (a GGUF's K-quant blocks as
    stored: Qwen3.5's out_proj) with the inverse as the layer's input order: the kernel
    over the gathered input, bit for bit, each row alone as in a batch; `rows` gives the
    weight in the input's order; the dense path above a threshold computes it too; and a
    compiled graph reads the order as a tensor (a changed order changes its output) while
    the layer's repr, which a compiled forward's key hashes, names it."""
    dtype = DTYPES[0]
    linear = random_linear(256, 48, dtype, bias=True)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    weight = linear.weight.detach()
    packed = group_linear.pack(*group_linear.quantize(weight[:, order], 8), 8)
    layer = QuantizedLinear(packed, linear.bias, None, dtype, order)
    x = torch.randn(2, 5, 256).to(dtype)
    with torch.inference_mode():
        out = layer(x)
        assert torch.equal(out, layer.kernel(x[..., order]))
        assert all(torch.equal(layer(x[:, i : i + 1]), out[:, i : i + 1]) for i in range(5))
        unordered = QuantizedLinear(packed, linear.bias, None, dtype)
        assert not torch.equal(out, unordered(x))
        thresholded = QuantizedLinear(packed, linear.bias, 2, dtype, order)
        dense = thresholded(x.reshape(10, 256)).reshape(out.shape)
    rows = layer.rows(torch.arange(48))
    assert torch.equal(rows, group_linear.unpack(packed)[:, order.argsort()])
    torch.testing.assert_close(rows, weight.float(), rtol=0, atol=2e-3)
    expected = (x.float() @ weight.float().T + linear.bias.float()).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)
    torch.testing.assert_close(dense, out, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="permutation"):
        QuantizedLinear(packed, None, None, dtype, torch.zeros(256, dtype=torch.int64))

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, options={"cpp_wrapper": True})
    before = repr(layer)
    with torch.inference_mode():
        assert torch.equal(compiled(x), out)
    layer.order.copy_(order.flip(0))
    assert repr(layer) != before
    with torch.inference_mode():
        changed = layer(x)
        assert not torch.equal(changed, out) and torch.equal(compiled(x), changed)


def test_linears_whose_inputs_are_not_whole_groups_stay_as_they_are():
    model = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 7))
    assert quantize_linear_layers(model, "int8", None) == 1
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is nn.Linear
    assert model(torch.randn(3, 64)).shape == (3, 7)


def test_the_kernel_takes_every_row_count_with_vnni_or_avx2_else_a_dense_copy_is_kept():
    vector = group_linear.EXTENSION.load().instruction_set in ("avx512-vnni", "avx2")
    for dtype in DTYPES:
        rows = max_kernel_rows(dtype)
        dense_path = not vector and (dtype == torch.float32 or can_pack(CPU, dtype))
        assert rows == (KERNEL_ROWS[dtype] if dense_path else None)
        layer = QuantizedLinear.quantizing(random_linear(128, 64, dtype), 8, rows)
        assert (layer.dense is None) == (rows is None)


def test_quantization_runs_only_on_the_cpu_in_fp32_and_bf16():
    assert "CPU only" in unavailable_reason(torch.device("cuda"), torch.float32, "int4")
    assert "float32 or bfloat16" in unavailable_reason(CPU, torch.float16, "int8")
    assert "unknown mode 'int2'" in unavailable_reason(CPU, torch.float32, "int2")


def test_quantization_on_cuda_or_in_fp16_is_a_config_error(tiny_model_paths: dict[str, Path]):
    with pytest.raises(ConfigError, match="CPU only"):
        load_config(EngineConfig, overrides={"device": "cuda", "quantization": "int4"}, environ={})
    with pytest.raises(ConfigError, match=r"quantization 'int8' cannot run .*float32 or bfloat16"):
        LLM(str(tiny_model_paths["llama"]), device="cpu", dtype="float16", quantization="int8")


def test_the_server_takes_quantization_from_flags_and_the_environment():
    args = build_parser().parse_args(["serve", "--quantization", "int4"])
    config = resolve_serve_config(None, {"quantization": args.quantization}, {})
    assert config.engine_config().quantization == "int4"
    config = resolve_serve_config(None, {}, {"PAGEDSERVE_QUANTIZATION": "int8"})
    assert config.engine_config().quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int2"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_engine_serves_a_quantized_model_alike_alone_and_batched(
    tiny_model_paths: dict[str, Path], dtype: torch.dtype, mode: str
):
    """Prompts of more rows than the threshold prefill on the dense path, alone or together,
    and three sequences decode on the kernel path alone or together: both row-invariant."""
    name = str(dtype).removeprefix("torch.")
    # Without prefix caching: a prefix hit would leave a prompt's rest to the kernel path.
    llm = LLM(
        str(tiny_model_paths["llama"]),
        device="cpu",
        dtype=name,
        quantization=mode,
        kv_cache_memory="16MiB",
        enable_prefix_caching=False,
    )
    model = llm.engine.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.get_output_embeddings().bits == HEAD_BITS
    assert model.model.layers[0].mlp.down_proj.bits == MODES[mode]
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


def test_int4_computes_the_default_models_own_q4_1_weights(default_model):
    """The default model's linears were converted from Q4_1: 4 bits give them back."""
    for linear in (
        default_model.model.model.layers[0].self_attn.q_proj,
        default_model.model.model.layers[29].mlp.down_proj,
    ):
        weight = linear.weight.detach()
        codes, scales, offsets = group_linear.quantize(weight, 4)
        assert torch.equal(group_linear.dequantize(codes, scales, offsets), weight)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gguf", *MODES])
def test_the_quantized_default_model_still_knows_its_capitals(mode: str):
    llm = LLM("default", quantization=mode, kv_cache_memory="32MiB", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    output = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    assert llm.engine.stats().used_kv_blocks == 0


@pytest.mark.slow
def test_the_scalar_code_gives_the_vector_codes_bits(tmp_path: Path):
    """The kernel's scalar twin (built with PAGEDSERVE_SCALAR_TWIN), which CPUs without
    AVX2 run, computes the same bits as the build this CPU runs, in every format (the
    affine ones per group of 32, GGUF's super-block ones per 256), at row counts that fill
    and split every run of rows, over inputs of more than one chunk of decoded groups."""
    from torch.utils import cpp_extension

    twin = cpp_extension.load(
        name="pagedserve_group_linear_scalar_twin",
        sources=[str(group_linear.EXTENSION.source)],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-DPAGEDSERVE_SCALAR_TWIN"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path),
    )
    assert twin.instruction_set == "scalar"
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    for ggml_type in KERNEL_TYPES:
        packed = to_packed(ggml_type, random_blocks(ggml_type, 50, 1280, rng))
        bias = torch.randn(50)
        for dtype in DTYPES:
            for rows in (1, 2, 3, 5, 7, 8, 9, 10, 11, 13, 15, 16, 17, 25):
                x = torch.randn(rows, 1280).to(dtype)
                args = (packed.codes, packed.scales, packed.offsets, packed.sub, packed.bits)
                got = twin.group_linear(x, *args, packed.scheme, 50, bias)
                assert torch.equal(got, group_linear.group_linear(x, packed, bias)), ggml_type


def test_auto_leaves_an_unquantized_checkpoint_unquantized(tiny_model_paths: dict[str, Path]):
    assert loader.checkpoint_quantization(str(tiny_model_paths["llama"])) == "none"
    llm = LLM(str(tiny_model_paths["llama"]), kv_cache_memory="4MiB")
    assert llm.engine.config.quantization == "auto" and llm.engine.quantization == "none"
    assert not any(isinstance(m, QuantizedLinear) for m in llm.engine.model.modules())


@pytest.mark.slow
def test_the_default_model_is_served_from_its_own_q4_1_and_q8_0_blocks():
    """quantization auto serves the default GGUF in its own types: its Q4_1 linears and its
    Q8_0 embedding, which is also the LM head, exactly as the file stores them."""
    assert loader.checkpoint_quantization("default") == "gguf"
    llm = LLM("default", kv_cache_memory="32MiB", max_model_len=256)
    assert llm.engine.quantization == "gguf"
    model = llm.engine.model
    layer = model.model.layers[0].self_attn.v_proj
    assert isinstance(layer, QuantizedLinear) and layer.bits == 4
    head = model.get_output_embeddings()
    assert head.bits == 8 and model.get_input_embeddings().table is head
    file = GGUFReader(loader.default_gguf_path())
    stored = {t.name: t for t in file.tensors}
    for name, weight in (("blk.0.attn_v.weight", layer.weight), ("token_embd.weight", head.weight)):
        tensor = stored[name]
        expected = dequantize(tensor.data, tensor.tensor_type)
        assert torch.equal(group_linear.unpack(weight), torch.from_numpy(expected))
