"""A PEFT LoRA adapter folder read and checked against the model it is to run on.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`), as
`peft`'s `save_pretrained` writes them. What pagedserve computes is plain LoRA: `y = x W^T
+ (x A^T) B^T * scaling` on a decoder's linear projections, with `scaling` `lora_alpha / r`
(`lora_alpha / sqrt(r)` under rsLoRA). Anything else a config asks for (DoRA, biases,
modules saved whole, per-module ranks, weights stored transposed) is refused by name, as
are a rank above `max_lora_rank`, a module the model does not have and a weight whose shape
is not the model's (an adapter trained on another base model): always when the adapter
loads, never at a request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# What peft writes before a module's path, and after it.
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}
# Config keys that would change what is computed, with the value that does not.
_PLAIN = {
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
}


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter's low-rank weights by module path (`model.layers.0.self_attn.q_proj`):
    `A [rank, in_features]` and `B [out_features, rank]`, float32, on the CPU."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(
    name: str, path: str, shapes: Mapping[str, tuple[int, int]], max_rank: int
) -> LoRAAdapter:
    """The adapter in folder `path`, for a model whose adaptable linears have `shapes`
    (module path -> (in_features, out_features)); AdapterError naming what is wrong."""
    folder = Path(path).expanduser()
    config = _config(name, folder)
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"adapter '{name}': 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"adapter '{name}' has rank {rank}, above max_lora_rank ({max_rank}): raise "
            "max_lora_rank to serve it"
        )
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _weights(name, folder, rank, shapes)
    return LoRAAdapter(name, str(folder), rank, float(scaling), weights)


def _config(name: str, folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"adapter '{name}': {file} not found (a PEFT adapter folder holds it)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter '{name}': cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter '{name}': {file} does not hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter '{name}' is a {config['peft_type']} adapter, not LoRA")
    for key, plain in _PLAIN.items():
        value = config.get(key)
        if value is None or value == plain or not (value or plain):
            continue
        raise AdapterError(f"adapter '{name}': {key} {value!r} is not supported (plain LoRA only)")
    return config


def _weights(
    name: str, folder: Path, rank: int, shapes: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    tensors = _tensors(name, folder)
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in tensors.items():
        module, kind = _module_of(name, key)
        pairs.setdefault(module, [None, None])[kind] = tensor
    weights = {}
    for module, (a, b) in sorted(pairs.items()):
        if module not in shapes:
            raise AdapterError(
                f"adapter '{name}' targets '{module}', which this model does not have (or "
                "not as a linear projection LoRA applies to)"
            )
        if a is None or b is None:
            raise AdapterError(f"adapter '{name}': '{module}' lacks its lora_A or lora_B")
        in_features, out_features = shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"adapter '{name}' does not fit this base model: '{module}' takes "
                f"{in_features} inputs to {out_features} outputs, the adapter's A is "
                f"{list(a.shape)} and B {list(b.shape)} (rank {rank})"
            )
        weights[module] = (a.float().contiguous(), b.float().contiguous())
    if not weights:
        raise AdapterError(f"adapter '{name}' holds no LoRA weights")
    return weights


def _tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = folder / file_name
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(file)
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a damaged file: any of several libraries' errors
            raise AdapterError(f"adapter '{name}': cannot read {file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise AdapterError(f"adapter '{name}': {file} does not hold a state dict")
        return loaded
    raise AdapterError(f"adapter '{name}': {folder} holds neither {' nor '.join(WEIGHT_FILES)}")


def _module_of(name: str, key: str) -> tuple[str, int]:
    """(module path, 0 for A or 1 for B) of a peft weight key."""
    for suffix, kind in _SUFFIXES.items():
        if key.endswith(suffix):
            return key.removeprefix(_PREFIX).removesuffix(suffix), kind
    raise AdapterError(f"adapter '{name}': '{key}' is not a LoRA weight (plain LoRA only)")
