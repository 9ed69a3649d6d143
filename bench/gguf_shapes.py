"""Random-weight GGUFs of real models' shapes, built with llama.cpp's own tools.

Speed and memory do not depend on the weights' values, so a Llama-3.2-1B, Llama-3.2-3B
or Llama-3.1-8B of random weights (normal, std 0.02; norms 1) served from the same GGUF by
pagedserve and llama-server measures what the real file would. So do the hybrid shapes:
Qwen3.5-0.8B and -4B (Gated DeltaNet and gated attention, 3:1; the text model of the
vision-language checkpoint, written as a text-only `Qwen3_5ForCausalLM` folder that the
converter writes as `qwen35`, without the multi-token-prediction head, so converted with
`--no-mtp`), LFM2-1.2B (short convolutions and attention; `lfm2`) and Granite-4.0-H-Micro
(Mamba-2 and attention, 9:1, dense; `granitehybrid`). Their norms start at scale 1 (a
zero-centred norm's weight at 0), their decay rates and time steps in the ranges the real
models are initialised in. `build_gguf(shape, type, folder)` writes the transformers folder
shard by shard in bf16 (never the whole model in memory), converts it with llama.cpp's
`convert_hf_to_gguf.py` to f16 and quantizes that with `llama-quantize` (both through
`../shared/peers/llama_server.sh`), keeping only the quantized file. The tokenizer is the
default model's (SmolLM2's, 49,152 tokens, which the converter knows as `smollm`); the
converter pads the vocabulary to the shape's own size, so the embedding and the LM head
have the real model's shapes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.model.loader import default_gguf_path

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
# Qwen3.5: interleaved multimodal RoPE on a quarter of each 256-wide head (text positions
# are the same on the three sections); three linear-attention layers to one full
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [11, 11, 10], "mrope_interleaved": True}  # fmt: skip


def qwen35_layers(layers: int) -> list[str]:
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


SHAPES: dict[str, dict] = {
    "llama-1b": {  # meta-llama/Llama-3.2-1B
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    },
    "llama-3b": {  # meta-llama/Llama-3.2-3B
        "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    },
    "llama-8b": {  # meta-llama/Llama-3.1-8B
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    },
    "qwen35-0.8b": {  # Qwen/Qwen3.5-0.8B's text_config
        "model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 24, "layer_types": qwen35_layers(24), "full_attention_interval": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "attn_output_gate": True, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": True, "rope_parameters": QWEN35_ROPE,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    },
    "qwen35-4b": {  # Qwen/Qwen3.5-4B's text_config
        "model_type": "qwen3_5_text", "hidden_size": 2560, "intermediate_size": 9216,
        "num_hidden_layers": 32, "layer_types": qwen35_layers(32), "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "attn_output_gate": True, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": True, "rope_parameters": QWEN35_ROPE,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    },
    "lfm2-1.2b": {  # LiquidAI/LFM2-1.2B (feed-forward 2/3 of 12288: 8192)
        "model_type": "lfm2", "hidden_size": 2048, "intermediate_size": 12288,
        "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256, "num_hidden_layers": 16,
        "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                        for i in range(16)],
        "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3,
        "conv_bias": False, "vocab_size": 65536, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 128000, "norm_eps": 1e-5,
    },
    "granite-h-micro": {  # ibm-granite/granite-4.0-h-micro (dense: no experts)
        "model_type": "granitemoehybrid", "hidden_size": 2048, "intermediate_size": 8192,
        "shared_intermediate_size": 8192, "num_local_experts": 0, "num_experts_per_tok": 0,
        "num_hidden_layers": 40,
        "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)],
        "num_attention_heads": 32, "num_key_value_heads": 8, "mamba_n_heads": 64,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "position_embedding_type": "nope", "embedding_multiplier": 12.0,
        "attention_multiplier": 0.015625, "residual_multiplier": 0.22, "logits_scaling": 8.0,
        "vocab_size": 100352, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    },
}  # fmt: skip
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}
# the converter's flags for a model type: a Qwen3.5 folder has no multi-token-prediction head
CONVERT_FLAGS = {"qwen3_5_text": ["--no-mtp"]}
# model types whose norms' weights are a scale's offset from 1 (`x * (1 + weight)`), so start
# at 0, but for the norms named: the gated norm in Qwen3.5's linear attention multiplies by its
# weight, as other models' norms do
ZERO_CENTRED_NORMS_BUT = {"qwen3_5_text": ("linear_attn.norm.weight",)}
SHARD_BYTES = 2 * 1024**3
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama_server.sh"


def peers_script() -> Path:
    """`llama_server.sh` of `../shared/peers` (or `$LLAMA_SERVER_SH`)."""
    script = Path(os.environ.get("LLAMA_SERVER_SH", PEERS))
    if not script.is_file():
        raise SystemExit(f"bench: llama.cpp's peer script is not at {script} (LLAMA_SERVER_SH)")
    return script


def initial(
    name: str, shape: torch.Size, model_type: str, generator: torch.Generator
) -> torch.Tensor:
    """A tensor's random starting value (fp32): std 0.02 for weights; norms at scale 1; a
    recurrent layer's decay rates `A_log` the log of [1, 16], its time-step biases
    `dt_bias` softplus's inverse of [0.001, 0.1] (log-uniform, as Mamba initialises them),
    its skip `D` 1."""
    if name.endswith("norm.weight"):
        plain = ZERO_CENTRED_NORMS_BUT.get(model_type)
        if plain is not None and not name.endswith(plain):
            return torch.zeros(shape)
        return torch.ones(shape)
    if name.endswith(".A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=generator).log()
    if name.endswith(".dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator)
        dt = dt.exp()
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith(".D"):
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02


def build_folder(shape: str, folder: Path, seed: int = 0) -> Path:
    """A transformers folder of `shape` with random bf16 weights and SmolLM2's tokenizer."""
    settings = dict(SHAPES[shape])
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings, dtype="bfloat16")
    config.architectures = [ARCHITECTURES[model_type]]
    with torch.device("meta"):
        names = {
            k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def write() -> None:
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, tensor_shape in names.items():
        tensor = initial(name, tensor_shape, model_type, generator).to(torch.bfloat16)
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > SHARD_BYTES:
            write()  # one shard in memory at a time
        shard[name] = tensor
    write()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    config.save_pretrained(folder)
    if "layer_types" in settings:  # the model's own names ("mamba", "conv"), which the
        # converter reads, where transformers writes its common ones ("linear_attention")
        written = json.loads((folder / "config.json").read_text())
        written["layer_types"] = settings["layer_types"]
        (folder / "config.json").write_text(json.dumps(written, indent=2))
    gguf = default_gguf_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def build_gguf(shape: str, ggml_type: str, root: Path) -> Path:
    """`root/<shape>-<type>.gguf`, built once (see the module docstring)."""
    out = root / f"{shape}-{ggml_type}.gguf"
    if out.is_file():
        return out
    script = peers_script()
    folder = build_folder(shape, root / f"{shape}-hf")
    f16 = root / f"{shape}-f16.gguf"
    flags = CONVERT_FLAGS.get(SHAPES[shape]["model_type"], [])
    subprocess.run(
        ["bash", str(script), "convert", str(folder), str(f16), "f16", *flags], check=True
    )
    partial = out.with_suffix(".partial")
    subprocess.run(["bash", str(script), "quantize", str(f16), str(partial), ggml_type], check=True)
    partial.rename(out)
    f16.unlink()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    return out


def default_model_gguf(ggml_type: str, root: Path) -> Path:
    """`root/SmolLM2-135M-Instruct-<type>.gguf`: the default model (a real one) in another
    type, built once: its Q4_1 GGUF dequantized to an fp32 transformers folder, converted
    to f16 and quantized by llama.cpp's own tools. (A 576-wide model: llama-quantize keeps
    a K type only for rows of a multiple of 256 inputs and falls back to Q5_0, Q5_1 or
    Q8_0 for the others, as it does for any such model.)"""
    from engine.model.loader import load_model

    out = root / f"SmolLM2-135M-Instruct-{ggml_type}.gguf"
    if out.is_file():
        return out
    folder = root / "SmolLM2-135M-Instruct-hf"
    if not (folder / "config.json").is_file():
        loaded = load_model("default", dtype=torch.float32, device=torch.device("cpu"))
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    script = peers_script()
    f16 = root / "SmolLM2-135M-Instruct-f16.gguf"
    if not f16.is_file():
        subprocess.run(["bash", str(script), "convert", str(folder), str(f16), "f16"], check=True)
    partial = out.with_suffix(".partial")
    subprocess.run(["bash", str(script), "quantize", str(f16), str(partial), ggml_type], check=True)
    partial.rename(out)
    return out
