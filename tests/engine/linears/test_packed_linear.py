"""Packed linear layers: row-invariant in every dtype the engine packs (bf16 on the
row-invariant kernel where it runs, `Bf16Linear`), oneDNN's bit-identical to `F.linear` in
bf16 and close to it in fp32, swapped in by the engine."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.linears import opaque_linear, packed_linear
from engine.linears.bf16_linear import Bf16Linear
from engine.linears.packed_linear import (
    MIN_ROWS,
    PackedLinear,
    can_pack,
    pack_linear_layers,
    padded_rows,
)
from engine.model.kernels import bf16_linear as bf16_kernel

CPU = torch.device("cpu")
requires_bf16_packing = pytest.mark.skipif(
    not can_pack(CPU, torch.bfloat16),
    reason="oneDNN cannot compute bf16 on this CPU",
)


@requires_bf16_packing
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_bit_for_bit_in_bf16(rows: int, bias: bool):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        for x in (torch.randn(rows, 96, dtype=torch.bfloat16), torch.randn(1, rows, 96).bfloat16()):
            expected = F.linear(x, linear.weight, linear.bias)
            assert torch.equal(packed(x), expected)


def test_can_pack_only_exact_dtypes_this_cpu_computes():
    cpu = torch.device("cpu")
    mkldnn = torch.backends.mkldnn.is_available()
    assert can_pack(cpu, torch.bfloat16) == (
        mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert can_pack(cpu, torch.float16) == (mkldnn and torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert can_pack(cpu, torch.float32) == mkldnn
    assert not can_pack(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_whatever_can_pack_allows_packs_and_runs(dtype: torch.dtype):
    linear = nn.Linear(64, 32, dtype=dtype)
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN cannot compute {dtype} on this CPU")
    x = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias))


PACKED_DTYPES = [d for d in (torch.float32, torch.bfloat16, torch.float16) if can_pack(CPU, d)]
# Known defect of oneDNN's packed bf16 linear, where the engine still packs bf16 with it (a
# CPU without AVX512-BF16, or no C++ compiler): on a 2-core AVX512-BF16 machine of
# 2026-11-25 (no AMX) it gave rows of 3- to 40-row calls other bits than the same rows of a
# 600-row call (576 -> 1536: 3 to 32 rows; 1536 -> 576: 33 to 40), and on an AMX one the
# same day too; its blocking follows the CPU it runs on. The row-invariant kernel
# (`Bf16Linear`) replaces it wherever the CPU has AVX512-BF16.
BF16_ROWS_DEFECT = pytest.mark.xfail(
    reason="oneDNN's bf16 blocking changes a row's bits with the row count on some CPUs",
    strict=False,
)
# The layers the engine packs here: per dtype, and the bf16 kernel on each instruction set
# (AMX where the CPU has it, which the engine uses then, and AVX512-BF16 everywhere else).
LAYER_CASES = [pytest.param(d, True, id=str(d).removeprefix("torch.")) for d in PACKED_DTYPES]
if torch.bfloat16 in PACKED_DTYPES:
    LAYER_CASES.append(pytest.param(torch.bfloat16, False, id="bfloat16-without-amx"))


@pytest.mark.parametrize(("dtype", "amx"), LAYER_CASES)
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (64, 4096)])
def test_a_rows_bits_do_not_depend_on_how_many_rows_run_with_it(
    dtype: torch.dtype, amx: bool, in_features: int, out_features: int, request
):
    """Every row count a step can have, against the same rows inside a 600-row call, for
    the layer `pack_linear_layers` makes of a linear of `dtype`."""
    torch.manual_seed(in_features)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False, dtype=dtype))
    pack_linear_layers(model)
    layer = model[0]
    if isinstance(layer, PackedLinear) and dtype == torch.bfloat16:
        request.applymarker(BF16_ROWS_DEFECT)
    if not amx:
        if not isinstance(layer, Bf16Linear):
            pytest.skip("the bf16 kernel does not run here")
        bf16_kernel.EXTENSION.load().set_amx(False)
    x = torch.randn(600, in_features).to(dtype)
    try:
        with torch.inference_mode():
            reference = layer(x)
            for rows in [*range(1, 41), 63, 64, 65, 127, 128, 200, 512]:
                differing = (layer(x[:rows]) != reference[:rows]).any(dim=1).sum().item()
                assert differing == 0, f"{differing} of {rows} rows differ"
    finally:
        if not amx:
            bf16_kernel.EXTENSION.load().set_amx(True)


def test_fp32_packing_stays_close_to_f_linear_and_keeps_shapes():
    if not can_pack(CPU, torch.float32):
        pytest.skip("oneDNN is not available")
    linear = nn.Linear(96, 160)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        for x in (torch.randn(1, 96), torch.randn(1, 1, 96), torch.randn(2, 5, 96)):
            out = packed(x)
            assert out.shape == (*x.shape[:-1], 160)
            torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias))


def test_row_counts_are_padded_to_few_shapes_at_little_cost():
    """oneDNN keeps a primitive per input shape: every row count of a step up to 1,024
    must map to few shapes (so the caches never evict), each at most 1/8 larger."""
    assert len({padded_rows(rows) for rows in range(1, 1025)}) == 63
    for rows in range(1, 5000):
        padded = padded_rows(rows)
        assert max(rows, MIN_ROWS) <= padded < max(rows * 9 / 8, MIN_ROWS + 1)
        assert padded_rows(padded) == padded


def test_a_call_runs_at_its_padded_row_count_and_returns_its_own_rows():
    if not can_pack(CPU, torch.float32):
        pytest.skip("oneDNN is not available")
    packed = PackedLinear(nn.Linear(64, 48))
    computed: list[int] = []
    linear = packed._linear

    def recording(x: torch.Tensor) -> torch.Tensor:
        computed.append(x.numel() // 64)
        return linear(x)

    packed._linear = recording  # type: ignore[method-assign]
    x = torch.randn(1, 17, 64)
    with torch.inference_mode():
        out = packed(x)
        alone = packed(x[0, :16])
    assert computed == [18, 16]
    assert out.shape == (1, 17, 48)
    assert torch.equal(out[0, :16], alone)  # rows keep their bits whatever the padding


@requires_bf16_packing
def test_packing_a_model_keeps_its_logits(tiny_model_path: Path):
    """Bit for bit where oneDNN packs bf16; where the row-invariant kernel does, its sums run
    in another order than `F.linear`'s, so the logits are close (a few bf16 steps after the
    model's layers), not equal."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True  # the packed head must leave the embedding intact
    model.lm_head.weight = model.get_input_embeddings().weight
    reference = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linear_layers(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.equal(model.get_input_embeddings().weight, reference.get_input_embeddings().weight)
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.inference_mode():
        got, expected = model(ids).logits, reference(ids).logits
    if any(isinstance(m, Bf16Linear) for m in model.modules()):
        torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)
    else:
        assert torch.equal(got, expected)


@requires_bf16_packing
def test_bf16_engine_packs_and_generates_as_unpacked(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Paged attention", "The quick brown fox jumps", "a"]

    def generate() -> tuple[LLM, list[list[int]]]:
        llm = LLM(
            str(tiny_model_paths["llama"]), device="cpu", dtype="bfloat16",
            kv_cache_memory="16MiB",
        )  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [list(output.outputs[0].token_ids) for output in outputs]

    packed_llm, packed = generate()
    kind = Bf16Linear if bf16_kernel.unavailable_reason() is None else PackedLinear
    assert any(isinstance(m, kind) for m in packed_llm.engine.model.modules())
    monkeypatch.setattr(packed_linear, "can_pack", lambda device, dtype: False)
    plain_llm, plain = generate()
    assert not any(isinstance(m, kind) for m in plain_llm.engine.model.modules())
    assert packed == plain


@pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="oneDNN cannot pack here")
def test_a_model_built_again_after_its_engine_is_dropped_gets_the_same_handles():
    """The handles are constants of compiled graphs: a second copy built after the first
    was dropped (in a reference cycle, as engines are) reuses its handles, so it loads the
    saved graph; a copy built while the first lives gets handles of its own."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 8))
        pack_linear_layers(model)
        model.cycle = [model]  # type: ignore[assignment]
        return model

    def handles(model: nn.Module) -> list[int]:
        return [module.handle for module in model.modules() if hasattr(module, "handle")]

    first = build()
    taken = handles(first)
    assert len(taken) == 3
    beside = build()
    assert not set(handles(beside)) & set(taken)
    del first
    again = build()
    assert handles(again) == taken
    assert all(opaque_linear.layer(h) is m for h, m in zip(taken, list(again)[:3], strict=True))
