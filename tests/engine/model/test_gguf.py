"""A GGUF read in place: each GGML type computed as stored, the file's architecture and
tokenizer, tensors with no place refused, and the converted form cached and mapped.

The files are written by `gguf`'s own writer (tests/support/gguf_files.py) with random blocks of
each type; the reference is the same file dequantized by gguf into a transformers model in
fp32 (`quantization: none`), the model GGML's types stand for.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from transformers import BertConfig, BertModel

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.linears import ggml_blocks
from engine.linears.quantized_embedding import QuantizedEmbedding
from engine.linears.quantized_linear import QuantizedLinear, unavailable_reason
from engine.model import loader
from engine.model.kernels import group_linear
from tests.support.gguf_files import KERNEL_TYPES, random_blocks, served, write_gguf

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    unavailable_reason(CPU, torch.float32, "gguf") is not None,
    reason="the C++ kernel cannot be built here",
)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [200, 100, 50, 25], list(range(40, 70))]


def reference(path: Path):
    """The file dequantized by gguf into a transformers model in fp32."""
    return loader.load_model(str(path), dtype=torch.float32, device=CPU)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES)
def test_each_types_blocks_repack_to_the_very_weights_gguf_reads(ggml_type: str):
    rng = np.random.default_rng(1)
    blocks = random_blocks(ggml_type, 37, 512, rng)  # a partial last tile
    packed = ggml_blocks.to_packed(ggml_type, blocks)
    expected = dequantize(blocks, GGMLQuantizationType[ggml_type])
    assert torch.equal(group_linear.unpack(packed), torch.from_numpy(expected))
    rows = torch.tensor([36, 0, 17])
    assert torch.equal(group_linear.unpack(packed, rows), torch.from_numpy(expected[rows.numpy()]))


def rounded_inputs(x: torch.Tensor, per: int) -> torch.Tensor:
    """x as the kernel rounds it: int8 codes per `per` inputs (scale max|x| / 127) times
    their scale."""
    rows, k = x.shape
    groups = x.reshape(rows, k // per, per)
    scale = groups.abs().amax(dim=2, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(groups / scale), torch.zeros_like(groups))
    return (codes * scale).reshape(rows, k)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES)
def test_the_kernel_computes_the_weights_against_the_rounded_inputs(ggml_type: str):
    """Every part of a weight, its scaled codes and its offset or minimum alike, meets the
    same rounded inputs, as in llama.cpp's Q8_1 and Q8_K dot products: for weights centred
    on zero their rounding errors cancel. (An offset against the inputs' exact sum does
    not: the default model's linears then erred 2.5 times as much.)"""
    rng = np.random.default_rng(2)
    packed = ggml_blocks.to_packed(ggml_type, random_blocks(ggml_type, 48, 512, rng))
    weight = group_linear.unpack(packed).double()
    x = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
    per = 256 if ggml_type.endswith("_K") else 32
    expected = rounded_inputs(x.double(), per) @ weight.T
    got = group_linear.group_linear(x, packed).double()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    exact = x.double() @ weight.T
    assert ((got - exact).norm() / exact.norm()).item() > 1e-3  # the inputs' rounding shows


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES)
def test_a_gguf_loads_in_its_own_type_with_the_files_exact_weights(
    tmp_path: Path, cache: Path, ggml_type: str
):
    """Every linear and the embedding, through the loader, the cache and its memory map,
    hold exactly what gguf dequantizes (Llama's permuted q and k rows put back)."""
    path = write_gguf(tmp_path / f"tiny-{ggml_type}.gguf", ggml_type)
    llm = served(path, enforce_eager=True)
    assert llm.engine.quantization == "gguf"
    expected = reference(path).model.state_dict()
    model = llm.engine.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 2 * 7 + 2  # the decoder's linears, the head and the embedding's table
    for name, module in model.named_modules():
        if isinstance(module, QuantizedEmbedding):
            weight = expected[f"{name}.weight"]
            assert torch.equal(group_linear.unpack(module.weight), weight)
            assert torch.equal(module(torch.tensor([[3, 1]]))[0], weight[[3, 1]])
        elif isinstance(module, QuantizedLinear) and not name.endswith(".table"):
            assert torch.equal(group_linear.unpack(module.weight), expected[f"{name}.weight"])
    norm = model.model.layers[1].post_attention_layernorm.weight
    assert torch.equal(norm, expected["model.layers.1.post_attention_layernorm.weight"])


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES)
def test_greedy_tokens_follow_the_dequantized_model(tmp_path: Path, cache: Path, ggml_type: str):
    """The kernel quantizes its inputs to int8, as llama.cpp does (per 32 inputs for the
    affine types, per 256 for the K types), so its logits are not the fp32 model's bits.
    At each step the fp32 model reads the engine's own tokens so far; the engine's
    log-probability of its token stays within `TOLERANCE` logit deviations of the fp32
    model's (measured at most 0.12 on these random models, whose flat logits make the
    inputs' rounding weigh most), and its greedy token is the fp32 model's wherever the top
    two are further apart than twice that."""
    path = write_gguf(tmp_path / f"tiny-{ggml_type}.gguf", ggml_type)
    llm = served(path, enforce_eager=True)
    model = reference(path).model
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    compared = 0
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        ids = list(prompt)
        sample = output.outputs[0]
        for token, logprob in zip(sample.token_ids, sample.logprobs, strict=True):
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0, -1].double()
            expected = torch.log_softmax(logits, -1)
            tolerance = TOLERANCE * logits.std().item()
            assert abs(logprob.logprob - expected[token].item()) < tolerance
            top2 = expected.topk(2).values
            if top2[0] - top2[1] > 2 * tolerance:
                assert token == int(expected.argmax())
                compared += 1
            ids.append(token)
    assert compared >= 10


TOLERANCE = 0.2


def test_a_head_tied_to_the_embedding_shares_its_table(tmp_path: Path, cache: Path):
    path = write_gguf(tmp_path / "tied.gguf", "Q6_K", tied=True)
    llm = served(path, enforce_eager=True)
    model = llm.engine.model
    assert model.get_input_embeddings().table is model.get_output_embeddings()
    output = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4


def test_a_file_of_mixed_types_and_biases_serves_each_in_its_own(tmp_path: Path, cache: Path):
    """A Q4_K_M-like mix (Q6_K head and some down projections) in Qwen2's layout, whose
    q, k and v have biases: one compiled step computes them all."""
    types = {
        "output.weight": "Q6_K",
        "blk.1.ffn_down.weight": "Q6_K",
        "blk.0.attn_v.weight": "Q8_0",
    }
    path = write_gguf(tmp_path / "mixed.gguf", "Q4_K", architecture="qwen2", types=types)
    llm = served(path, enforce_eager=False)
    model = llm.engine.model
    assert llm.engine.compiled and model.config.model_type == "qwen2"
    assert model.model.layers[1].mlp.down_proj.weight.scheme == group_linear.SUPER_SIGNED
    assert model.model.layers[0].self_attn.v_proj.bits == 8
    expected = reference(path).model.state_dict()
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert torch.equal(bias, expected["model.layers.0.self_attn.q_proj.bias"])
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
    eager = served(path, enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    compiled = llm.generate(PROMPTS, params, use_tqdm=False)
    # The compiled graph fuses the norms, whose last bits can move one of the kernel's int8
    # codes of x: the same tokens, logprobs within a code's step.
    for one, other in zip(eager, compiled, strict=True):
        assert other.outputs[0].token_ids == one.outputs[0].token_ids
        got = [lp.logprob for lp in other.outputs[0].logprobs]
        want = [lp.logprob for lp in one.outputs[0].logprobs]
        assert np.allclose(got, want, atol=2e-2)


def test_quantization_none_serves_a_gguf_dequantized(tmp_path: Path, cache: Path):
    path = write_gguf(tmp_path / "tiny.gguf", "Q5_K")
    llm = served(path, quantization="none", enforce_eager=True)
    assert llm.engine.quantization == "none"
    assert not any(isinstance(m, QuantizedLinear) for m in llm.engine.model.modules())
    assert not (cache / "quantized").exists()  # nothing converted for the kernel


def test_quantization_gguf_needs_a_quantized_gguf(tmp_path: Path, cache: Path, tiny_model_paths):
    with pytest.raises(ConfigError, match="quantization 'gguf' serves a GGUF file's own"):
        LLM(str(tiny_model_paths["llama"]), quantization="gguf", kv_cache_memory="4MiB")
    floats = write_gguf(tmp_path / "f32.gguf", "F32")
    assert loader.checkpoint_quantization(str(floats)) == "none"
    assert loader.checkpoint_quantization(str(write_gguf(tmp_path / "q.gguf", "Q4_0"))) == "gguf"


def test_a_type_without_a_kernel_is_quantized_again_and_said_so(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
):
    types = {f"blk.{i}.ffn_{p}.weight": "Q3_K" for i in range(2) for p in ("gate", "up")}
    path = write_gguf(tmp_path / "q3.gguf", "Q4_K", types=types)
    for _ in range(2):  # converted, then loaded from the cache: said at every start
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            llm = served(path, enforce_eager=True)
        assert (
            "q3.gguf: 4 tensor(s) of type Q3_K have no kernel: quantized again to 8-bit "
            "groups, with loss" in caplog.text
        )
    gate = llm.engine.model.model.layers[0].mlp.gate_proj
    assert gate.bits == 8
    exact = reference(path).model.state_dict()["model.layers.0.mlp.gate_proj.weight"]
    error = (group_linear.unpack(gate.weight) - exact).abs().max()
    assert 0 < error < 0.01 * exact.abs().max()


def test_an_architecture_pagedserve_does_not_serve_is_refused_before_any_weight(
    tmp_path: Path, cache: Path
):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(path, "mamba")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'mamba' is not one"):
        LLM(str(path), kv_cache_memory="4MiB")


def test_a_tensor_with_no_place_in_the_model_is_refused_by_name(tmp_path: Path, cache: Path):
    extra = {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}
    path = write_gguf(tmp_path / "extra.gguf", "Q8_0", extra_tensors=extra)
    with pytest.raises(
        UnsupportedModelError, match=r"tensor 'blk\.0\.attn_sinks\.weight' has no place"
    ):
        served(path, enforce_eager=True)


def test_a_folder_that_lacks_weights_is_refused_by_name(tmp_path: Path):
    """An encoder's folder (all-MiniLM-L6-v2's layout: a BertModel) would load as
    BertLMHeadModel with a randomly initialised head."""
    config = BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=37,
    )  # fmt: skip
    BertModel(config).save_pretrained(tmp_path / "minilm")
    (tmp_path / "minilm" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "a"] * 33))
    with pytest.raises(
        ModelLoadError, match=r"lacks weights its architecture \(BertLMHeadModel\) needs: cls\."
    ):
        loader.load_model(str(tmp_path / "minilm"), dtype=torch.float32, device=CPU)


def test_later_starts_map_the_converted_file_without_reading_the_gguf(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
):
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_K")
    served(path, enforce_eager=True)
    [converted] = (cache / "quantized").glob("tiny-*/weights.safetensors")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        llm = served(path, enforce_eager=True)
    assert not [r.message for r in caplog.records if r.name == "engine.first_use"]
    assert llm.engine.quantization == "gguf"
    assert str(converted) in Path("/proc/self/maps").read_text()
    # Keyed by the file: a file written again is converted again.
    os.utime(path, ns=(0, 0))
    with caplog.at_level(logging.INFO, logger="engine.first_use"):
        served(path, enforce_eager=True)
    assert f"converting {path.name}'s tensors for the kernels once" in caplog.text
    assert converted.exists()


# Loads the GGUF in argv[2] the way the engine does, after the small one in argv[1] (which
# imports and loads everything else), and prints the RSS before and the peak: VmHWM, this
# process's own high-water mark (getrusage's ru_maxrss keeps the parent's across exec).
_PEAK = textwrap.dedent(
    """
    import gc, sys
    from pathlib import Path
    import psutil, torch
    from engine import capabilities
    from engine.model.loader import load_model
    install = capabilities.gguf_install(torch.float32)
    cpu = torch.device("cpu")
    load_model(sys.argv[1], dtype=torch.float32, device=cpu, install=install)
    gc.collect()
    before = psutil.Process().memory_info().rss
    load_model(sys.argv[2], dtype=torch.float32, device=cpu, install=install)
    status = Path("/proc/self/status").read_text().split("VmHWM:")[1]
    print(before, int(status.split()[0]) * 1024)
    """
)


@pytest.mark.slow
def test_the_first_start_holds_the_model_at_most_once_and_a_third(tmp_path: Path, cache: Path):
    """A 190 MB Q8_0 file: converting it and mapping the result never holds it twice."""
    path = write_gguf(
        tmp_path / "big.gguf", "Q8_0", hidden=2048, intermediate=5632, layers=4, heads=16,
        kv_heads=4,
    )  # fmt: skip
    tensors = sum(t.n_bytes for t in GGUFReader(path).tensors)
    assert tensors > 150e6
    # Warm the kernel and the metadata first: their builds are not the loader's memory.
    warm = write_gguf(tmp_path / "warm.gguf", "Q8_0")
    served(warm, enforce_eager=True)
    loader.metadata_folder(path)
    env = os.environ | {"PAGEDSERVE_CACHE": str(cache)}
    command = [sys.executable, "-c", _PEAK, str(warm), str(path)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    before, peak = map(int, result.stdout.split()[-2:])
    assert peak - before < 1.3 * tensors, (peak - before) / tensors
