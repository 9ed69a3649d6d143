"""Gemma 4's GGUFs (`gemma4`) as llama.cpp's converter writes them: the config read from the
metadata (two KV shapes, shared KV, K as V, per-layer inputs, the shared layers' double-wide
MLPs, a softcap, proportional rope from `rope_freqs`) builds the folder's model, each file
loads to the folder's very tensors, generates its greedy tokens and tokenizes as its
tokenizer does, and in Q8_0 computes its linears as stored; a file with experts, or rope
factors that are not Gemma 4's, is refused by name.

The files are written by tests/support/gguf_hybrid_files.py, whose output was checked
against the converter's own for the same folders (metadata, tensor names, shapes, types
and bytes): CI has no llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import LLM
from engine.errors import UnsupportedModelError
from engine.linears.packed_linear import PackedLinear
from engine.linears.quantized_embedding import QuantizedEmbedding
from engine.linears.quantized_linear import QuantizedLinear, unavailable_reason
from engine.model.gguf import metadata_folder
from tests.support.architectures import SERVED, prompts, reference
from tests.support.gguf_files import dense, served
from tests.support.gguf_hybrid_files import build_gemma4, write_hybrid_gguf
from tests.support.greedy import engine_greedy

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    unavailable_reason(CPU, torch.float32, "gguf") is not None,
    reason="the C++ kernel cannot be built here",
)
# The coverage matrix's tiny Gemma 4 (sliding and global layers of head sizes 32 and 64,
# 2 and 1 KV heads, K as V in the global ones, the last two layers reading the first two's
# KV, per-layer inputs), its per-layer table as long as its vocabulary (as llama.cpp takes
# it; transformers' default is Gemma's 262,144 rows).
GEMMA4 = {**SERVED["gemma4"][1], "vocab_size_per_layer_input": 384}
FOLDERS = {
    "gemma4": GEMMA4,
    "tied": {**GEMMA4, "tie_word_embeddings": True, "final_logit_softcapping": 30.0},
    "plain": {
        **GEMMA4, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
    },
    "wide": {**GEMMA4, "use_double_wide_mlp": True},  # the shared layers' MLPs twice as wide
}  # fmt: skip
# What the config must hold as the folder's does.
FIELDS = (
    "layer_types", "head_dim", "num_key_value_heads", "attention_k_eq_v",
    "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
    "intermediate_size", "use_double_wide_mlp", "sliding_window", "final_logit_softcapping",
    "rope_parameters", "tie_word_embeddings", "vocab_size", "num_attention_heads",
)  # fmt: skip
MAX_TOKENS = 10
# Prompts of 5 and 50 tokens (past the window of 16).
BATCH = [prompts(384)[0], prompts(384)[2]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    return {name: build_gemma4(root / name, fields) for name, fields in FOLDERS.items()}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_a_converted_file_loads_to_its_folders_config_and_very_tensors(
    tmp_path: Path, cache: Path, folders: dict[str, Path], name: str
):
    """The config from the metadata is the folder's (per-layer head sizes and KV heads,
    sharing, K as V, per-layer inputs, the rope of each layer type from `rope_freqs`), and
    every parameter and layer scalar is the folder's, as stored (no norm shifted)."""
    path = write_hybrid_gguf(folders[name], tmp_path / f"{name}.gguf", "F32")
    config = AutoConfig.from_pretrained(metadata_folder(path))
    original = AutoConfig.from_pretrained(folders[name])
    got, expected = config.to_dict(), original.to_dict()
    for field in FIELDS:
        assert got[field] == expected[field], field
    for i in range(original.num_hidden_layers):
        layer, folder_layer = config.per_layer_config[i], original.per_layer_config[i]
        assert layer.head_dim == folder_layer.head_dim, i
        assert layer.num_key_value_heads == folder_layer.num_key_value_heads, i
    folder = AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
    weights, loaded = folder.state_dict(), dense(path)
    assert sorted(loaded) == sorted(weights)
    for key, value in weights.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("name", ["gemma4", "wide"])
def test_greedy_tokens_are_the_folders_in_fp32(
    tmp_path: Path, cache: Path, folders: dict[str, Path], name: str
):
    """The F16 file (as the converter writes it by default) served in fp32 generates what
    transformers generates from the folder, and its tokenizer (`gemma4`: the BPE with byte
    fallback, BOS left to the chat template as transformers' Gemma 4 tokenizer does) is the
    folder's."""
    path = write_hybrid_gguf(folders[name], tmp_path / f"{name}.gguf", "F16")
    llm = served(path, enforce_eager=True)
    assert engine_greedy(llm, BATCH, MAX_TOKENS) == reference(folders[name], BATCH, MAX_TOKENS)
    tokenizer, original = llm.get_tokenizer(), AutoTokenizer.from_pretrained(folders[name])
    assert tokenizer.get_vocab() == original.get_vocab()
    assert tokenizer.eos_token == original.eos_token == "<eos>"
    text = "The quick brown fox jumps over the lazy dog, Ω\n\n<|turn>"
    assert tokenizer.encode(text) == original.encode(text)
    assert tokenizer.chat_template == original.chat_template


def test_a_q8_0_file_computes_every_linear_in_its_own_blocks(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    """Each linear a kernel's over exactly the weights gguf dequantizes but the two llama.cpp
    keeps in F16 (`per_layer_model_proj`, and `proj`, whose 16 columns are no whole block);
    the token and per-layer tables quantized embeddings; the layer scalars and norms as
    stored; the tokens those of the file dequantized."""
    path = write_hybrid_gguf(folders["gemma4"], tmp_path / "q8.gguf", "Q8_0")
    llm = served(path, enforce_eager=True)
    assert llm.engine.quantization == "gguf"
    expected = dense(path)
    model = llm.engine.model
    kinds = (nn.Linear, PackedLinear, QuantizedLinear)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, kinds)}
    quantized = {n for n, m in linears.items() if isinstance(m, QuantizedLinear)}
    kept = {
        n for n in linears if n.endswith(("per_layer_projection", "per_layer_model_projection"))
    }
    assert set(linears) - quantized == kept and len(kept) == 5
    embeddings = {"model.embed_tokens", "model.embed_tokens_per_layer"}
    assert all(isinstance(model.get_submodule(n), QuantizedEmbedding) for n in embeddings)
    for module in quantized - {f"{n}.table" for n in embeddings}:
        weight = linears[module].rows(torch.arange(linears[module].out_features))
        assert torch.equal(weight, expected[f"{module}.weight"]), module
    for key, parameter in model.named_parameters():  # norms, scalars, F16 projections
        if key in expected:
            assert torch.equal(parameter, expected[key]), key
    twin = served(path, enforce_eager=True, quantization="none")
    assert engine_greedy(llm, BATCH, MAX_TOKENS) == engine_greedy(twin, BATCH, MAX_TOKENS)


def test_a_file_with_experts_is_refused_in_one_line(tmp_path: Path, cache: Path):
    path = tmp_path / "gemma4-moe.gguf"
    writer = GGUFWriter(path, "gemma4")
    writer.add_block_count(2)
    writer.add_expert_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError,
        match=r"^gemma4-moe\.gguf: GGUF architecture 'gemma4' with experts is a mixture of "
        r"experts: MoE GGUFs are not served yet$",
    ):
        LLM(str(path), kv_cache_memory="4MiB")


def test_rope_factors_that_are_not_proportional_rope_are_refused(
    tmp_path: Path, cache: Path, folders: dict[str, Path]
):
    """Factors other than Gemma 4's 1s and 1e30s would scale frequencies the config cannot."""
    factors = np.full(32, 2.0, np.float32)
    path = write_hybrid_gguf(
        folders["gemma4"], tmp_path / "rope.gguf", extra_tensors={"rope_freqs.weight": factors}
    )
    with pytest.raises(UnsupportedModelError, match=r"'rope_freqs\.weight' is not proportional"):
        served(path, enforce_eager=True)
