"""A GGUF file read in place: its architecture, config and tokenizer from the metadata, and
its tensors under transformers' names, each read only when asked for.

The metadata is read once per file (gguf's `GGUFReader`; parsing a 128,256-token
vocabulary's fields and converting it into a tokenizer takes seconds) into a folder under
`$PAGEDSERVE_CACHE/gguf` (`metadata_folder`): the config and tokenizer transformers' own
GGUF mapping makes, plus what that mapping leaves out (Llama 3's rotary frequency factors,
`rope_freqs.weight`, applied to the model's `inv_freq`; a linear rope scaling; an
embedder's pooling) and an index of the tensors (name, type, shape, offset); an encoder's
file is written as a sentence-transformers folder (`gguf_encoder.py`). An architecture
pagedserve does not serve (`ARCHITECTURES`, `ENCODER_ARCHITECTURES`) is refused there,
naming it, before any weight is read. Later
starts read that folder; `GgufFile` maps the file (a numpy memory map) and finds each
tensor by the index.

A hybrid's file (Qwen3.5, Qwen3-Next, LFM2, Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1:
`gguf_hybrid.py`), and Gemma 4's, which transformers' mapping reads in part, has its
config written from tables of llama.cpp's keys, and its tensors (and buffers: Gemma 4's
layer scalars) placed by tables of the converter's names and transforms
(`GgufFile._placed`): stored tensors joined into one parameter (`StoredRows`), rows
reordered, columns reordered (the kernel takes a quantized weight's blocks as stored, its
input gathered in the inverse order: `GgufTensor.columns`), values undone.

`GgufFile.tensors(model)` names each tensor by the transformers parameter it holds (gguf's
tensor name map, as transformers' `get_gguf_hf_weights_map` uses it) and says how
transformers' processor for the architecture lays it out: Llama's q and k rows are stored
permuted for llama.cpp's rotary embedding, a row order that a quantized tensor's blocks can
take as they are (`GgufTensor.rows`); other processors change values (Gemma's norms are
stored plus one), which only the dequantized tensor can take (`GgufTensor.dense`). A tensor
with no place in the model is refused by name, so a file is never served in part.
"""

from __future__ import annotations

import json
import mmap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
from gguf import (
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFReader,
    get_tensor_name_map,
)
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    GGUFTensor,
    TensorProcessor,
)

from engine.config import cache_root
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.first_use import build_once
from engine.model.gguf_encoder import (
    ENCODER_ARCHITECTURES,
    head_names,
    metadata_field,
    parameter_names,
    write_decoder_pooling,
    write_encoder_folder,
)
from engine.model.gguf_hybrid import (
    HYBRID_ARCHITECTURES,
    MOE_ARCHITECTURES,
    MOE_REFUSAL,
    Placement,
    placements,
    unread,
    write_hybrid_folder,
)

# GGUF architecture names (`general.architecture`) pagedserve serves, each exactly: its
# transformers config and model compute what llama.cpp computes for it. Mistral's models
# are "llama" files (transformers reads them as Mistral's by their `general.name`). The
# hybrids' config and tensors are `gguf_hybrid.py`'s.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", *HYBRID_ARCHITECTURES)
# A tensor that holds no transformers parameter but is read here.
ROPE_FREQS = "rope_freqs.weight"
# Written last into a metadata folder: the file's architecture, tensor index and factors;
# a folder of another `FORMAT` (an older pagedserve's) is made again.
SOURCE_FILE = "pagedserve_gguf.json"
FORMAT = "pagedserve-gguf-metadata-2"
FLOAT_TYPES = ("F32", "F16", "BF16")


def file_key(path: Path) -> str:
    """The cache key of a GGUF file: its resolved path, size and modification time."""
    stat = path.stat()
    return xxhash.xxh64(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file under a transformers parameter's name.

    `blocks` is the file's own data, memory-mapped: `[rows, bytes per row]` for a block
    type, the values `[rows, columns]` (or `[columns]`) for F32, F16 and BF16; or several
    stored tensors read as one (`StoredRows`, a hybrid's joined tensors). `shape` is the
    parameter's. `rows` is the order of the stored rows that gives transformers' layout
    (None: as stored); `columns` that of the stored columns
    (`parameter[:, j] = stored[:, columns[j]]`; None: as stored), which `dense` applies and
    a kernel over the blocks as stored takes as its input order (`argsort(columns)`);
    `row_order_only` is false where the processor does more than reorder rows and columns
    (changes values), which only `dense` applies.
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    blocks: np.ndarray | StoredRows
    rows: np.ndarray | None
    row_order_only: bool
    processor: TensorProcessor
    columns: np.ndarray | None = None

    def dense(self) -> torch.Tensor:
        """The tensor in fp32, as transformers lays it out: GGML's dequantization."""
        if isinstance(self.blocks, StoredRows):
            values = self.blocks.values()
        else:
            values = dequantize(self.blocks, GGMLQuantizationType[self.ggml_type])
        values = self.processor.process(weights=values.reshape(self.shape), name=self.name).weights
        return torch.from_numpy(np.array(values, dtype=np.float32))

    def rows_dequantized(self, order: slice | np.ndarray) -> torch.Tensor:
        """Stored rows `order` of a matrix whose processor only reorders rows, in fp32."""
        values = dequantize(np.asarray(self.blocks[order]), GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.array(values, dtype=np.float32))


class GgufFile:
    """A GGUF file, memory-mapped, its tensors found by its metadata folder's index (made
    first if missing, see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        source = read_source(metadata_folder(path))
        self.architecture: str = source["architecture"]
        self.index: list[list] = source["tensors"]
        self.mapped = np.memmap(path, dtype=np.uint8, mode="r")

    def blocks(self, entry: list) -> np.ndarray:
        """An index entry's data: `[rows, bytes per row]` of blocks, or the values."""
        _, ggml_type, shape, offset, size = entry
        data = self.mapped[offset : offset + size]
        if ggml_type in ("F32", "F16"):
            return data.view(np.float32 if ggml_type == "F32" else np.float16).reshape(shape)
        return data.reshape(shape[0] if len(shape) > 1 else 1, -1)

    def tensors(self, model: PreTrainedModel) -> dict[str, GgufTensor]:
        """Every tensor the model takes, by its parameter's name (see the module docstring).
        Raises `UnsupportedModelError` naming a tensor that has no place in the model."""
        if self.architecture in HYBRID_ARCHITECTURES:
            return self._placed(model)
        processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(
            config=model.config.to_dict()
        )
        names = parameter_names(self.architecture, model) or {
            **_parameter_names(model, processor, self.architecture),
            **head_names(self.architecture, model),
        }
        tensors = {}
        for entry in self.index:
            name, ggml_type, shape = entry[:3]
            if name == ROPE_FREQS:
                continue
            if name not in names:
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor '{name}' has no place in transformers' "
                    f"{model.config.model_type} model, so it would not be computed"
                )
            if isinstance(names[name], tuple):  # fused rows, taken in equal parts
                tensors.update(self._split(entry, names[name], processor))
                continue
            rows = _row_order(processor, name, tuple(shape))
            tensors[names[name]] = GgufTensor(
                name, ggml_type, tuple(shape), self.blocks(entry),
                rows if rows is not False else None, rows is not False, processor,
            )  # fmt: skip
        return tensors

    def _placed(self, model: PreTrainedModel) -> dict[str, GgufTensor]:
        """A hybrid's tensors by `gguf_hybrid.placements` (a parameter whose stored tensors
        the file lacks is left out, for the loader to name). Raises `UnsupportedModelError`
        naming a stored tensor that no parameter takes and that is not left unread."""
        entries = {entry[0]: entry for entry in self.index}
        named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers())
        shapes = {name: tuple(p.shape) for name, p in named}  # buffers: Gemma 4's layer_scalar
        tensors, used = {}, set()
        for name, candidates in placements(model.config).items():
            held = (p for p in candidates if all(source in entries for source in p.sources))
            placement = next(held, None)
            if name in shapes and placement is not None:
                parts = [entries[source] for source in placement.sources]
                tensors[name] = self._join(parts, placement, shapes[name])
                used.update(placement.sources)
        for stored in entries:
            if stored not in used and not unread(model.config, stored):
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor '{stored}' has no place in transformers' "
                    f"{model.config.model_type} model, so it would not be computed"
                )
        return tensors

    def _join(self, parts: list[list], placement: Placement, shape: tuple[int, ...]) -> GgufTensor:
        """Stored tensors as one parameter: read as they are (for the kernel, its input in
        the inverse of the column order) where only their rows and columns are reordered;
        otherwise only `dense` (mixed types are that, under the name F32)."""
        types = {entry[1] for entry in parts}
        mixed = len(types) > 1
        data = [self.blocks(entry) for entry in parts]
        blocks = (
            data[0]
            if len(parts) == 1
            else StoredRows(data, [entry[1] for entry in parts], placement.axis)
        )
        return GgufTensor(
            parts[0][0], "F32" if mixed else parts[0][1], shape, blocks, placement.rows,
            placement.undo is None and not mixed, _Undone(placement), placement.columns,
        )  # fmt: skip

    def _split(
        self, entry: list, targets: tuple[str, ...], processor: TensorProcessor
    ) -> dict[str, GgufTensor]:
        """A fused matrix's stored rows as `targets`, in turn (dense only)."""
        name, ggml_type, (rows, columns) = entry[:3]
        part = rows // len(targets)
        blocks = self.blocks(entry)
        return {
            target: GgufTensor(
                name,
                ggml_type,
                (part, columns),
                blocks[i * part : (i + 1) * part],
                None,
                False,
                processor,
            )
            for i, target in enumerate(targets)
        }

    def drop_pages(self) -> None:
        """Let go of the file's pages this process has touched (the kernel keeps them in
        its page cache): a conversion that reads the file once does not hold it all."""
        self.mapped._mmap.madvise(mmap.MADV_DONTNEED)


class StoredRows:
    """Stored tensors read as one: their rows one after another (`axis` 0), or each
    leading row (an expert's matrix) of one followed by the same row of the next (`axis`
    1). Indexing gives the stored data of the rows asked for, in the order asked (parts of
    one type); `values` dequantizes."""

    def __init__(self, parts: list[np.ndarray], types: list[str], axis: int) -> None:
        self.parts = [part.reshape(len(part), -1) for part in parts]
        self.types, self.axis = types, axis
        widths = [part.shape[1] for part in self.parts]
        rows = [len(part) for part in self.parts]
        self.shape = (sum(rows), widths[0]) if axis == 0 else (rows[0], sum(widths))
        self.starts = np.cumsum([0, *rows])

    def __getitem__(self, index: slice | np.ndarray) -> np.ndarray:
        if self.axis == 1:
            return np.concatenate([part[index] for part in self.parts], axis=1)
        rows = np.arange(self.shape[0])[index]
        out = np.empty((len(rows), self.shape[1]), dtype=self.parts[0].dtype)
        for part, start, stop in zip(self.parts, self.starts, self.starts[1:], strict=False):
            mine = (rows >= start) & (rows < stop)
            out[mine] = part[rows[mine] - start]
        return out

    def values(self) -> np.ndarray:
        """The joined tensor, dequantized (each part by its own type where they differ)."""
        if len(set(self.types)) == 1:
            return dequantize(self[:], GGMLQuantizationType[self.types[0]])
        values = [
            dequantize(part, GGMLQuantizationType[kind]).reshape(len(part), -1)
            for part, kind in zip(self.parts, self.types, strict=True)
        ]
        return np.concatenate(values, axis=self.axis)


class _Undone(TensorProcessor):
    """A hybrid's placement applied to the dequantized values: the value transform, the
    row order and the column order."""

    def __init__(self, placement: Placement) -> None:
        super().__init__()
        self.placement = placement

    def process(self, weights: np.ndarray, name: str, **kwargs) -> GGUFTensor:
        placement = self.placement
        if placement.undo is not None:
            weights = placement.undo(weights)
        if placement.rows is not None:
            weights = weights[placement.rows]
        if placement.columns is not None:
            weights = weights[:, placement.columns]
        return GGUFTensor(weights, name, {})


def _parameter_names(
    model: PreTrainedModel, processor: TensorProcessor, architecture: str
) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name: gguf's name map, built once (as
    `get_gguf_hf_weights_map` reads it, which builds it again for every submodule), a
    name it lacks tried again without the base model's prefix (a sequence classifier's
    `bert.`)."""
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    prefix = f"{model.base_model_prefix}."
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        name = processor.preprocess_name(hf_name)
        base, dot, suffix = name.rpartition(".")
        gguf_name = None
        if suffix in ("weight", "bias"):
            gguf_name = name_map.get_name(base) or name_map.get_name(base.removeprefix(prefix))
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(names, f"{dot}{suffix}", "", name)
            continue
        names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _row_order(processor: TensorProcessor, name: str, shape: tuple[int, ...]):
    """The stored-row order of transformers' layout (None: as stored), or False where the
    processor does more than reorder a matrix's rows."""
    if len(shape) != 2:
        return None
    index = np.arange(shape[0], dtype=np.float64)[:, None]
    moved = np.asarray(processor.process(weights=index, name=name).weights)
    if moved.shape != index.shape or not np.array_equal(np.sort(moved[:, 0]), index[:, 0]):
        return False
    order = moved[:, 0].astype(np.int64)
    return None if np.array_equal(order, index[:, 0]) else order


def metadata_folder(path: Path) -> Path:
    """The folder of `path`'s config, tokenizer, rotary factors and tensor index, made once
    (see the module docstring): `AutoConfig` and `AutoTokenizer` load it."""
    target = cache_root() / "gguf" / f"{path.stem}-{file_key(path)}"
    build_once(
        target,
        lambda staging: _write_metadata(path, staging),
        complete=_complete,
        doing=f"reading {path.name}'s config and tokenizer",
        expected="seconds",
        done="read",
        # Rewritten at every load of the default model (`ensure_generation_config`).
        rewritten=("generation_config.json",),
    )
    return target


def _complete(folder: Path) -> bool:
    try:
        return read_source(folder)["format"] == FORMAT
    except (OSError, ValueError, KeyError):
        return False


def _write_metadata(path: Path, staging: Path) -> None:
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises many kinds for a damaged or foreign file
        raise ModelLoadError(f"{path.name} is not a readable GGUF file: {exc}") from None
    architecture = metadata_field(reader, path, "general.architecture")
    if architecture in ENCODER_ARCHITECTURES:
        write_encoder_folder(reader, path, staging, architecture)
    elif architecture in MOE_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture '{architecture}' is {MOE_REFUSAL}"
        )
    elif architecture in HYBRID_ARCHITECTURES:
        write_hybrid_folder(reader, path, staging, architecture)
    elif architecture in ARCHITECTURES:
        _write_decoder_folder(reader, path, staging, architecture)
    else:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture '{architecture}' is not one pagedserve serves "
            f"({', '.join((*ARCHITECTURES, *ENCODER_ARCHITECTURES))})"
        )
    source = {
        "format": FORMAT,
        "gguf": path.name,
        "architecture": architecture,
        "types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        # A hybrid's config holds its rotary factors, if any (Gemma 4's proportional rope).
        "rope_freqs": None if architecture in HYBRID_ARCHITECTURES else _rope_freqs(reader),
        "tensors": [_entry(tensor) for tensor in reader.tensors],
    }
    (staging / SOURCE_FILE).write_text(json.dumps(source) + "\n")  # last: marks it complete


def _write_decoder_folder(reader: GGUFReader, path: Path, staging: Path, architecture: str) -> None:
    """The config and tokenizer transformers' GGUF mapping makes of a decoder's file, with
    what that mapping leaves out (a linear rope scaling, Mistral's full attention), and the
    pooling an embedder's file names."""
    scaling = metadata_field(reader, path, f"{architecture}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(
            f"{path.name}: rope scaling '{scaling}' is not read from GGUF metadata"
        )
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if scaling == "linear":
        factor = float(metadata_field(reader, path, f"{architecture}.rope.scaling.factor"))
        config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": factor}
    if config.model_type == "mistral":  # llama.cpp attends in full: no window in the file
        config.sliding_window = None
    config.save_pretrained(staging)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(staging)
    write_decoder_pooling(reader, path, architecture, staging)


def _entry(tensor) -> list:
    """[name, type, shape (torch's order), offset, bytes] of a reader's tensor."""
    shape = [int(d) for d in reversed(tensor.shape.tolist())]
    per_block = GGML_QUANT_SIZES[tensor.tensor_type][0]
    if shape[-1] % per_block:
        raise ModelLoadError(f"tensor '{tensor.name}' is not a whole number of blocks")
    return [
        tensor.name,
        tensor.tensor_type.name,
        shape,
        int(tensor.data_offset),
        int(tensor.n_bytes),
    ]


def _rope_freqs(reader: GGUFReader) -> list[float] | None:
    """Llama 3's rotary frequency factors, where the file holds them."""
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            return [float(v) for v in dequantize(tensor.data, tensor.tensor_type)]
    return None


def read_source(folder: Path) -> dict:
    """What `metadata_folder` recorded of the file (architecture, types, index, factors)."""
    return json.loads((folder / SOURCE_FILE).read_text())


def quantized(folder: Path) -> bool:
    """Whether the GGUF whose metadata folder this is stores tensors in GGML block types."""
    return any(name not in FLOAT_TYPES for name in read_source(folder)["types"])
