"""Hybrid models' GGUFs (Qwen3.5, Qwen3-Next, LFM2, Granite 4.0-H, Bamba, Nemotron-H,
Falcon-H1) as llama.cpp's converter writes them: each loads to the very tensors of the
folder it was converted from, generates its greedy tokens, and in Q8_0 computes its
linears as stored (Qwen3.5's out_proj in Q4_K too, its input reordered); mixture-of-experts
files are refused by name.

The files are written by tests/support/gguf_hybrid_files.py, whose output was checked
against the converter's own for the same folders (metadata, tensor names, shapes, types
and bytes): CI has no llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from engine import LLM
from engine.errors import UnsupportedModelError
from engine.linears import gguf_store
from engine.linears.packed_linear import PackedLinear
from engine.linears.quantized_linear import QuantizedLinear, unavailable_reason
from engine.model.kernels import group_linear
from tests.support.architectures import HYBRID, build, prompts, reference
from tests.support.gguf_files import dense, served
from tests.support.gguf_hybrid_files import write_hybrid_gguf
from tests.support.greedy import engine_greedy

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    unavailable_reason(CPU, torch.float32, "gguf") is not None,
    reason="the C++ kernel cannot be built here",
)
GRANITE = {
    **HYBRID["granitemoehybrid"][1], "num_local_experts": 0, "num_experts_per_tok": 0,
    "embedding_multiplier": 3.0, "attention_multiplier": 0.05, "residual_multiplier": 0.5,
    "logits_scaling": 2.0, "position_embedding_type": "nope",
}  # fmt: skip
FALCON_H1 = {
    **HYBRID["falcon_h1"][1], "mamba_rms_norm": True, "mamba_norm_before_gate": False,
    "embedding_multiplier": 2.5, "lm_head_multiplier": 0.7, "attention_in_multiplier": 1.5,
    "attention_out_multiplier": 0.8, "key_multiplier": 0.9, "ssm_in_multiplier": 1.3,
    "ssm_out_multiplier": 0.6, "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.05],
    "mlp_multipliers": [1.25, 0.75],
}  # fmt: skip
# name -> (model type, config fields): one folder of each architecture the files hold.
FOLDERS = {
    "qwen3_5": HYBRID["qwen3_5"],
    "qwen3_next": HYBRID["qwen3_next"],
    "lfm2": ("lfm2", {**HYBRID["lfm2"][1], "tie_word_embeddings": True}),  # as LFM2's
    "granite": ("granitemoehybrid", GRANITE),
    "bamba": HYBRID["bamba"],
    "nemotron_h": HYBRID["nemotron_h"],
    "falcon_h1": ("falcon_h1", FALCON_H1),
    # Value heads of 64: out_proj's 256 columns (4 value heads over 2 key heads, stored
    # tiled) are one Q4_K super-block.
    "qwen3_5-wide": ("qwen3_5_text", {**HYBRID["qwen3_5"][1], "linear_value_head_dim": 64}),
    "granite-moe": ("granitemoehybrid", {**GRANITE, "num_local_experts": 4}),
}
# Falcon-H1's multipliers, as the converter multiplies them into each weight.
FALCON_H1_SCALES = {
    "embed_tokens": [2.5], "lm_head": [0.7], "q_proj": [1.5], "v_proj": [1.5],
    "k_proj": [0.9, 1.5], "o_proj": [0.8], "in_proj": [1.3], "out_proj": [0.6],
    "gate_proj": [1.25], "down_proj": [0.75],
}  # fmt: skip
MAX_TOKENS = 10
# Prompts of 5 and 50 tokens.
BATCH = [prompts(384)[0], prompts(384)[2]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {name: build(root / name, *FOLDERS[name]) for name in FOLDERS}


def matrix(layer: QuantizedLinear) -> torch.Tensor:
    """A quantized layer's weight as the model's parameter (its columns in input order)."""
    return layer.rows(torch.arange(layer.out_features))


def stored(name: str, value: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """What the file holds of a folder's parameter, put back: a norm stored `w + 1` comes
    back as `fl(w + 1) - 1`; Falcon-H1's multipliers are in its weights (z, x, B, C and
    dt of the SSM's in-projection each times its own too)."""
    if config.model_type in ("qwen3_5_text", "qwen3_next") and name.endswith("norm.weight"):
        return value if "linear_attn.norm" in name else (value + 1) - 1
    if config.model_type != "falcon_h1":
        return value
    module = name.rpartition(".")[0].rpartition(".")[2]
    for multiplier in FALCON_H1_SCALES.get(module, ()):
        value = value * np.float32(multiplier)
    if module == "in_proj":
        inner, groups = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
        bounds = [0, inner, 2 * inner, 2 * inner + groups, 2 * (inner + groups), len(value)]
        parts = zip(config.ssm_multipliers, bounds[:-1], bounds[1:], strict=True)
        value = torch.cat([value[a:b] * np.float32(m) for m, a, b in parts])
    return value


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "lfm2", "granite", "bamba",
                                  "nemotron_h", "falcon_h1"])  # fmt: skip
def test_a_converted_file_loads_to_its_folders_very_tensors(
    tmp_path: Path, cache: Path, folders: dict[str, Path], name: str
):
    """Every parameter, undone from the converter's layout: permuted rows, joined and
    regrouped matrices, `-exp(A_log)` (back to an ulp), squeezed shapes, norms plus one."""
    path = write_hybrid_gguf(folders[name], tmp_path / f"{name}.gguf", "F32")
    folder = AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
    expected = folder.state_dict()
    got = dense(path)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        value = stored(key, value, folder.config)
        if key.endswith("A_log"):
            torch.testing.assert_close(got[key], value, rtol=2e-7, atol=0, msg=key)
        else:
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "lfm2", "granite", "bamba",
                                  "nemotron_h", "falcon_h1"])  # fmt: skip
def test_greedy_tokens_are_the_folders_in_fp32(
    tmp_path: Path, cache: Path, folders: dict[str, Path], name: str
):
    """The served file generates what transformers generates from the folder (Falcon-H1's:
    its multipliers in the weights, not in the config), and tokenizes as it does."""
    path = write_hybrid_gguf(folders[name], tmp_path / f"{name}.gguf", "F32")
    llm = served(path, enforce_eager=True)
    assert engine_greedy(llm, BATCH, MAX_TOKENS) == reference(folders[name], BATCH, MAX_TOKENS)
    tokenizer, original = llm.get_tokenizer(), AutoTokenizer.from_pretrained(folders[name])
    assert tokenizer.get_vocab() == original.get_vocab()
    assert tokenizer.eos_token == original.eos_token == "<|im_end|>"
    text = "The quick brown fox jumps over the lazy dog"
    assert tokenizer.encode(text) == original.encode(text)
    assert tokenizer.chat_template == original.chat_template


def test_a_qwen3_next_file_of_the_older_converter_loads_its_whole_qkvz(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    """`ssm_in`: in_proj_qkvz as transformers lays it out, before the converter split it."""
    path = write_hybrid_gguf(folders["qwen3_next"], tmp_path / "legacy.gguf", legacy=True)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    folder = AutoModelForCausalLM.from_pretrained(folders["qwen3_next"], dtype=torch.float32)
    assert torch.equal(dense(path)[name], folder.state_dict()[name])


def test_a_qwen_file_with_a_draft_head_serves_the_model_without_it(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    """A multi-token-prediction block (`nextn_predict_layers`) is not a layer: not read."""
    path = write_hybrid_gguf(folders["qwen3_5"], tmp_path / "mtp.gguf", "F32", draft_head=True)
    llm = served(path, enforce_eager=True)
    assert llm.engine.model.config.num_hidden_layers == 2
    assert engine_greedy(llm, BATCH, MAX_TOKENS) == reference(folders["qwen3_5"], BATCH, MAX_TOKENS)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "lfm2", "granite", "falcon_h1"])
def test_a_q8_0_file_computes_every_linear_in_its_own_blocks(
    tmp_path: Path, cache: Path, folders: dict[str, Path], name: str
):
    """Joined (Qwen3-Next's qkvz, Granite's shared MLP), row-permuted (Qwen3.5's value
    heads, Granite's q and k) and column-permuted (Qwen3.5's out_proj, its input
    reordered) weights alike: each linear a kernel's, over exactly the weights gguf
    dequantizes (and LFM2's head its embedding's table); the other parameters
    (Qwen3-Next's experts among them) dequantized."""
    path = write_hybrid_gguf(folders[name], tmp_path / f"{name}-q8.gguf", "Q8_0")
    llm = served(path, enforce_eager=True)
    assert llm.engine.quantization == "gguf"
    expected = dense(path)
    model = llm.engine.model
    kinds = (nn.Linear, PackedLinear, QuantizedLinear)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, kinds)}
    quantized = {n for n, m in linears.items() if isinstance(m, QuantizedLinear)}
    # All but Qwen3-Next's shared expert gate, which the converter stores in F32.
    assert all(n.endswith("shared_expert_gate") for n in set(linears) - quantized)
    for module in quantized - {"model.embed_tokens.table"}:
        assert torch.equal(matrix(linears[module]), expected[f"{module}.weight"]), module
        reordered = name == "qwen3_5" and module.endswith("linear_attn.out_proj")
        assert (linears[module].order is not None) == reordered, module
    for key, parameter in model.named_parameters():  # norms, convolutions, experts...
        if key in expected:
            assert torch.equal(parameter, expected[key]), key
    if model.config.tie_word_embeddings:
        assert model.get_input_embeddings().table is model.get_output_embeddings()
    tokens = engine_greedy(llm, BATCH, MAX_TOKENS)
    assert [len(t) for t in tokens] == [MAX_TOKENS] * 2


def test_a_k_quant_out_proj_keeps_its_blocks_and_reorders_its_input(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    """Qwen3.5's out_proj in Q4_K, its value heads (64 columns each, 4 over 2 key heads)
    stored tiled within one 256-wide super-block, which no order of whole blocks puts
    back: a kernel's layer over the file's own blocks as stored, its input gathered in the
    inverse of the column order (kept through the conversion's cache), computing the
    weight gguf dequantizes in transformers' layout; greedy tokens those of `generate()`
    in fp32 with that weight."""
    path = write_hybrid_gguf(
        folders["qwen3_5-wide"], tmp_path / "wide.gguf", "F32",
        types={"blk.0.ssm_out.weight": "Q4_K"},
    )  # fmt: skip
    name = "model.layers.0.linear_attn.out_proj"
    stored = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ssm_out.weight")
    weight = dense(path)[f"{name}.weight"]
    twin = AutoModelForCausalLM.from_pretrained(folders["qwen3_5-wide"], dtype=torch.float32)
    twin.get_submodule(name).weight.data.copy_(weight)
    twin.save_pretrained(tmp_path / "twin")
    expected = reference(tmp_path / "twin", BATCH, MAX_TOKENS)
    blocks = torch.from_numpy(dequantize(stored.data, GGMLQuantizationType.Q4_K))
    for start in ("converting", "mapping the converted file"):
        llm = served(path, enforce_eager=True)
        layer = llm.engine.model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear), start
        assert layer.weight.scheme == group_linear.SUPER_MIN and layer.bits == 4
        assert torch.equal(group_linear.unpack(layer.weight), blocks), start
        assert not torch.equal(layer.order, torch.arange(256)), start
        assert torch.equal(matrix(layer), weight), start
        assert engine_greedy(llm, BATCH, MAX_TOKENS) == expected, start
        x = torch.randn(3, 256)
        with torch.inference_mode():
            error = (layer(x) - x @ weight.T).abs().max()
        assert error < 0.02 * (x @ weight.T).abs().max(), start
        del llm
    (converted,) = (cache / "quantized").glob(f"*/{gguf_store.WEIGHTS_FILE}")
    tensors, _, _ = gguf_store.map_tensors(converted)
    assert torch.equal(tensors[f"{name}.weight.order"].long(), layer.order)


def test_weights_the_kernel_cannot_take_as_stored_are_served_dequantized(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    """Qwen3-Next's qkvz joined from two types: the dequantized weights."""
    path = write_hybrid_gguf(
        folders["qwen3_next"], tmp_path / "mixed.gguf", "Q8_0",
        types={"blk.0.attn_gate.weight": "Q4_0"},
    )  # fmt: skip
    model = served(path, enforce_eager=True).engine.model
    layer = model.get_submodule("model.layers.0.linear_attn.in_proj_qkvz")
    assert not isinstance(layer, QuantizedLinear)
    weight = dense(path)["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    with torch.inference_mode():  # the engine's own (packed) fp32 linear, as a matrix
        computed = layer(torch.eye(weight.shape[1])).T
    torch.testing.assert_close(computed, weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("architecture", ["qwen35moe", "lfm2moe", "nemotron_h_moe"])
def test_a_mixture_of_experts_file_is_refused_in_one_line(
    tmp_path: Path, cache: Path, architecture: str
):
    path = tmp_path / f"{architecture}.gguf"
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError,
        match=rf"^{architecture}\.gguf: GGUF architecture '{architecture}' is a mixture of "
        r"experts: MoE GGUFs are not served yet$",
    ):
        LLM(str(path), kv_cache_memory="4MiB")


def test_a_granite_file_with_experts_is_refused_in_one_line(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    path = write_hybrid_gguf(folders["granite-moe"], tmp_path / "granite-moe.gguf", "F16")
    with pytest.raises(
        UnsupportedModelError,
        match=r"^granite-moe\.gguf: GGUF architecture 'granitehybrid' with experts is a "
        r"mixture of experts: MoE GGUFs are not served yet$",
    ):
        LLM(str(path), kv_cache_memory="4MiB")


def test_a_tensor_with_no_place_in_a_hybrid_is_refused_by_name(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    extra = {"blk.0.ssm_extra.weight": np.zeros(4, np.float32)}
    path = write_hybrid_gguf(folders["lfm2"], tmp_path / "extra.gguf", extra_tensors=extra)
    with pytest.raises(
        UnsupportedModelError, match=r"tensor 'blk\.0\.ssm_extra\.weight' has no place"
    ):
        served(path, enforce_eager=True)
