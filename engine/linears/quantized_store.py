"""Quantized weights made once per model and mode, then loaded (`quantization: int8|int4`).

Quantizing SmolLM2-135M's 211 linears took 0.9 s on a quiet 2-core CPU but 9 to 19 s
while other processes competed for its cores (torch's threads then wait on each other),
at every start; the packed result (98 MB in int4) loads in a fraction of a second.
`packed_weights` returns every eligible linear's `PackedWeight` by module name, from
`$PAGEDSERVE_CACHE/quantized/<key>/weights.safetensors`, made first if missing (once, safe
to race: `first_use.build_once`).

The weights quantized are the checkpoint's own, in fp32, read from the model folder's
safetensors where they are there (a layer missing there, such as a head tied to the input
embedding, is quantized from the loaded weight). So a Q4_1 GGUF converted to fp32 gives
back its very codes, scales and offsets in every dtype the model is served in, not those
of its bf16 rounding. The key hashes the folder's weight files (path, size, time), the
mode, the layers' names and shapes, and the format's source (`group_linear.py`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from engine.config import cache_root
from engine.first_use import build_once
from engine.model.kernels import group_linear
from engine.model.kernels.group_linear import PackedWeight

WEIGHTS_FILE = "weights.safetensors"
FORMAT = "pagedserve-quantized-2"


def packed_weights(
    linears: dict[str, nn.Linear], bits_of: Callable[[str], int], mode: str, folder: Path | None
) -> dict[str, PackedWeight]:
    """`PackedWeight` of each of `linears` (by module name) at `bits_of(name)` bits, loaded
    from the cache, made and saved there first if missing. `folder`: the model's folder,
    whose safetensors hold the fp32 weights (None: quantize the loaded weights, unsaved)."""
    if folder is None:
        return _quantize_all(linears, bits_of, {})
    target = cache_root() / "quantized" / _key(linears, mode, folder)
    build_once(
        target,
        lambda staging: _save(_quantize_all(linears, bits_of, _file_weights(folder)), staging),
        complete=lambda path: (path / WEIGHTS_FILE).is_file(),
        doing=f"quantizing the model's linears to {mode}",
        expected="seconds, once per model and mode",
        done="quantized",
    )
    return _load(target / WEIGHTS_FILE)


def _quantize_all(
    linears: dict[str, nn.Linear], bits_of: Callable[[str], int], files: dict[str, Path]
) -> dict[str, PackedWeight]:
    packed = {}
    for name, linear in linears.items():
        weight = _weight(files, f"{name}.weight", linear)
        bits = bits_of(name)
        packed[name] = group_linear.pack(*group_linear.quantize(weight, bits), bits)
    return packed


def _weight(files: dict[str, Path], key: str, linear: nn.Linear) -> torch.Tensor:
    """The fp32 weight named `key` from the safetensors file that holds it, else the
    loaded one."""
    if key in files:
        with safe_open(files[key], framework="pt") as file:
            return file.get_tensor(key).float()
    return linear.weight.detach()


def _file_weights(folder: Path) -> dict[str, Path]:
    """Which of the folder's safetensors files holds each tensor name."""
    where = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as file:
            where.update(dict.fromkeys(file.keys(), path))
    return where


def _save(packed: dict[str, PackedWeight], staging: Path) -> None:
    tensors, shapes = {}, {}
    for name, weight in packed.items():
        tensors |= {f"{name}.codes": weight.codes, f"{name}.scales": weight.scales}
        tensors[f"{name}.offsets"] = weight.offsets
        shapes[name] = [weight.bits, weight.out_features]  # affine: no small scales
    save_file(tensors, staging / WEIGHTS_FILE, metadata={"layers": json.dumps(shapes)})


def _load(path: Path) -> dict[str, PackedWeight]:
    with safe_open(path, framework="pt") as file:
        shapes = json.loads(file.metadata()["layers"])
    tensors = load_file(path)
    return {
        name: PackedWeight(
            tensors[f"{name}.codes"],
            tensors[f"{name}.scales"],
            tensors[f"{name}.offsets"],
            bits,
            out_features,
        )
        for name, (bits, out_features) in shapes.items()
    }


def _key(linears: dict[str, nn.Linear], mode: str, folder: Path) -> str:
    digest = hashlib.sha256()
    parts = [FORMAT, mode, str(folder.resolve())]
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    parts += [f"{name}:{tuple(linear.weight.shape)}" for name, linear in linears.items()]
    for part in parts:
        digest.update(part.encode() + b"\0")
    digest.update(Path(group_linear.__file__).read_bytes())
    return digest.hexdigest()[:16]
