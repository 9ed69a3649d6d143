"""Random-weight GGUFs of real models' shapes, built with llama.cpp's own tools.

Speed and memory do not depend on the weights' values, so a Llama-3.2-1B, Llama-3.2-3B
or Llama-3.1-8B of random weights (normal, std 0.02; norms 1) served from the same GGUF by
pagedserve and llama-server measures what the real file would. `build_gguf(shape, type,
folder)` writes the transformers folder shard by shard in bf16 (never the whole model in
memory), converts it with llama.cpp's `convert_hf_to_gguf.py` to f16 and quantizes that
with `llama-quantize` (both through `../shared/peers/llama_server.sh`), keeping only the
quantized file. The tokenizer is the default model's (SmolLM2's, 49,152 tokens); the
converter pads the vocabulary to the shape's own size, so the embedding and the LM head
have the real model's shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.model.loader import default_gguf_path

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
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
}  # fmt: skip
SHARD_BYTES = 2 * 1024**3
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama_server.sh"


def peers_script() -> Path:
    """`llama_server.sh` of `../shared/peers` (or `$LLAMA_SERVER_SH`)."""
    script = Path(os.environ.get("LLAMA_SERVER_SH", PEERS))
    if not script.is_file():
        raise SystemExit(f"bench: llama.cpp's peer script is not at {script} (LLAMA_SERVER_SH)")
    return script


def build_folder(shape: str, folder: Path, seed: int = 0) -> Path:
    """A transformers folder of `shape` with random bf16 weights and SmolLM2's tokenizer."""
    settings = dict(SHAPES[shape])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
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
        if name.endswith("norm.weight"):
            tensor = torch.ones(tensor_shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(tensor_shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > SHARD_BYTES:
            write()  # one shard in memory at a time
        shard[name] = tensor
    write()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    config.save_pretrained(folder)
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
    subprocess.run(["bash", str(script), "convert", str(folder), str(f16), "f16"], check=True)
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
