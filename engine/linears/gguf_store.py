"""A GGUF's tensors converted once into the forms the engine computes, then memory-mapped.

`install(model, path, dtype, kernel_rows)` fills a model built on the meta device from
`path`'s config (`engine/model/loader.py`) with the file's own weights:

- a linear or embedding weight stored in a type of `ggml_blocks.BLOCKS` becomes a
  `QuantizedLinear` or `QuantizedEmbedding` over the very same weights (the blocks
  repacked for the kernel, no value changed); a head tied to its embedding shares it; a
  linear whose columns are stored in another order (`GgufTensor.columns`: Qwen3.5's value
  heads) keeps its blocks as stored and gathers its input in the inverse order (its
  `order`, saved beside the weight as `<name>.order`, int32);
- one stored in another block type (Q2_K, Q3_K, the IQ types) is quantized again to int8
  groups, with loss, which start-up says in one line naming the type;
- everything else (norms, biases, F32/F16/BF16 weights) is kept as stored and computed in
  the model's dtype (an F16 or F32 weight in a bf16 model is rounded, which start-up says).

The conversion runs once per file and kernel format (`first_use.build_once`, safe to race)
and writes `$PAGEDSERVE_CACHE/quantized/<name>-<key>/weights.safetensors` tensor by tensor
(`TensorFile`), reading the GGUF in chunks of rows through its memory map and dropping
each chunk's pages once converted, so the first start never holds the model twice. Later
starts map that file (`map_tensors`) and do not open the GGUF: the pages a process touches
are its resident memory, shared with the page cache, as llama.cpp's are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.config import cache_root
from engine.first_use import build_once
from engine.linears import ggml_blocks
from engine.linears.quantized_embedding import QuantizedEmbedding
from engine.linears.quantized_linear import QuantizedLinear
from engine.model.gguf import FLOAT_TYPES, GgufFile, GgufTensor, file_key
from engine.model.kernels import group_linear
from engine.model.kernels.group_linear import AFFINE, SUPER_MIN, SUPER_SIGNED, PackedWeight

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.safetensors"
# Written last into a converted folder: what was converted, and how.
SOURCE_FILE = "pagedserve_converted.json"
FORMAT = "pagedserve-gguf-2"
ROW_CHUNK = 2048  # rows converted at a time (a multiple of group_linear.TILE)
REQUANTIZED_BITS = 8
_DTYPES = {
    "U8": torch.uint8, "I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32,
}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def install(model: nn.Module, path: Path, dtype: torch.dtype, kernel_rows: int | None) -> int:
    """Put `path`'s weights into `model` (see the module docstring), converting them first
    if this file's conversion is not cached; return the bytes of the file it maps."""
    target = cache_root() / "quantized" / f"{path.stem}-{_key(path)}"
    build_once(
        target,
        lambda staging: convert(GgufFile(path), model, staging),
        complete=lambda folder: (folder / SOURCE_FILE).is_file(),
        doing=f"converting {path.name}'s tensors for the kernels",
        expected="about 10 s per GB of the file, once",
        done="converted",
    )
    tensors, layers, notes = map_tensors(target / WEIGHTS_FILE)
    for note in notes:
        logger.warning("%s: %s", path.name, note)
    _place(model, tensors, layers, dtype, kernel_rows)
    return (target / WEIGHTS_FILE).stat().st_size


def _key(path: Path) -> str:
    digest = hashlib.sha256(f"{FORMAT}\0{file_key(path)}".encode())
    for module in (group_linear, ggml_blocks):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class _Entry:
    """How one parameter is stored: `packed` (the blocks as they are), `requantized` (int8
    groups of another block type) or `dense` (as stored)."""

    name: str
    tensor: GgufTensor
    kind: str

    def arrays(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The stored arrays' names, dtypes and shapes."""
        if self.kind == "dense":
            stored = self.tensor.ggml_type if self.tensor.ggml_type in FLOAT_TYPES else "F32"
            return {self.name: (stored, self.tensor.shape)}
        bits, scheme = self.format()
        n, k = self.tensor.shape
        tiles = -(-n // group_linear.TILE)
        rows = k // (group_linear.GROUP if scheme == AFFINE else group_linear.SUPER)
        arrays = {f"{self.name}.codes": ("U8", (tiles, k // group_linear.GROUP, 64 * bits))}
        arrays[f"{self.name}.scales"] = ("F16", (tiles, rows, group_linear.TILE))
        if scheme != SUPER_SIGNED:
            arrays[f"{self.name}.offsets"] = ("F16", (tiles, rows, group_linear.TILE))
        if scheme == SUPER_MIN:
            arrays[f"{self.name}.sub"] = ("U8", (tiles, k // group_linear.GROUP, 2, 16))
        elif scheme == SUPER_SIGNED:
            arrays[f"{self.name}.sub"] = ("U8", (tiles, k // 16, 16))
        if self.tensor.columns is not None:
            arrays[f"{self.name}.order"] = ("I32", (k,))
        return arrays

    def order(self) -> torch.Tensor:
        """The input order of a packed or requantized entry whose columns are reordered:
        the inverse of their order (see `QuantizedLinear`)."""
        return torch.from_numpy(np.argsort(self.tensor.columns).astype(np.int32))

    def format(self) -> tuple[int, int]:
        """(bits, scheme) of a packed or requantized entry."""
        if self.kind == "requantized":
            return REQUANTIZED_BITS, AFFINE
        return ggml_blocks.BLOCKS[self.tensor.ggml_type][2:]

    def chunks(self):
        """(first row, PackedWeight of the next rows) for a packed or requantized entry."""
        tensor = self.tensor
        for start in range(0, tensor.shape[0], ROW_CHUNK):
            stop = min(start + ROW_CHUNK, tensor.shape[0])
            order = slice(start, stop) if tensor.rows is None else tensor.rows[start:stop]
            if self.kind == "packed":
                yield start, ggml_blocks.to_packed(tensor.ggml_type, tensor.blocks[order])
            else:
                values = tensor.rows_dequantized(order)
                codes, scales, offsets = group_linear.quantize(values, REQUANTIZED_BITS)
                yield start, group_linear.pack(codes, scales, offsets, REQUANTIZED_BITS)


def _plan(gguf: GgufFile, model: nn.Module) -> list[_Entry]:
    modules = dict(model.named_modules())
    entries = []
    for name, tensor in gguf.tensors(model).items():
        module = modules[name.rpartition(".")[0]]
        matrix = name.endswith(".weight") and isinstance(module, nn.Linear | nn.Embedding)
        reordered = tensor.columns is not None and isinstance(module, nn.Embedding)
        if not matrix or reordered or tensor.ggml_type in FLOAT_TYPES:
            kind = "dense"
        elif tensor.ggml_type in ggml_blocks.BLOCKS and tensor.row_order_only:
            kind = "packed"
        elif tensor.shape[1] % group_linear.GROUP == 0 and tensor.row_order_only:
            kind = "requantized"
        else:
            kind = "dense"
        entries.append(_Entry(name, tensor, kind))
    return entries


def convert(gguf: GgufFile, model: nn.Module, staging: Path) -> None:
    """Write every tensor of `gguf` that `model` takes, converted, into the empty folder
    `staging`, then the file that marks it complete."""
    entries = _plan(gguf, model)
    types = Counter((entry.tensor.ggml_type, entry.kind) for entry in entries)
    notes = [
        f"{count} tensor(s) of type {ggml_type} have no kernel: quantized again to "
        f"{REQUANTIZED_BITS}-bit groups, with loss"
        for (ggml_type, kind), count in sorted(types.items())
        if kind == "requantized"
    ]
    layers = {e.name: [*e.format(), *e.tensor.shape] for e in entries if e.kind != "dense"}
    arrays = {name: spec for entry in entries for name, spec in entry.arrays().items()}
    metadata = {"layers": json.dumps(layers), "notes": json.dumps(notes)}
    with TensorFile(staging / WEIGHTS_FILE, arrays, metadata) as file:
        for entry in entries:
            if entry.kind == "dense":
                value = entry.tensor.dense().to(_DTYPES[arrays[entry.name][0]])
                file.write(entry.name, 0, value)
            else:
                _write_packed(file, entry, arrays)
            gguf.drop_pages()
    summary = ", ".join(f"{n} x {t} {k}" for (t, k), n in sorted(types.items()))
    logger.info("%s: %s", gguf.path.name, summary)
    source = {"gguf": gguf.path.name, "format": FORMAT, "tensors": summary}
    (staging / SOURCE_FILE).write_text(json.dumps(source) + "\n")  # last: marks it complete


def _write_packed(
    file: TensorFile, entry: _Entry, arrays: dict[str, tuple[str, tuple[int, ...]]]
) -> None:
    """Write a packed or requantized entry's parts (those among `arrays`), chunk by
    chunk, each at its tiles' offset, and its input order where it has one."""
    for start, packed in entry.chunks():
        tile = start // group_linear.TILE
        for part in ("codes", "scales", "offsets", "sub"):
            if f"{entry.name}.{part}" in arrays:
                values = getattr(packed, part)
                file.write(f"{entry.name}.{part}", tile * values[0].nbytes, values)
    if f"{entry.name}.order" in arrays:
        file.write(f"{entry.name}.order", 0, entry.order())


class TensorFile:
    """A safetensors file written in place: the header first, from every array's dtype and
    shape, then each array's bytes at its offset, in any order and in pieces. Arrays are
    laid out in the order given with no gaps (each a multiple of 4 bytes here, so fp16 and
    fp32 arrays stay aligned)."""

    def __init__(
        self, path: Path, arrays: dict[str, tuple[str, tuple[int, ...]]], metadata: dict
    ) -> None:
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name, (dtype, shape) in arrays.items():
            size = int(np.prod(shape)) * torch.empty((), dtype=_DTYPES[dtype]).element_size()
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        self.base = 8 + len(text)
        self.offsets = {
            name: entry["data_offsets"][0]
            for name, entry in header.items()
            if name != "__metadata__"
        }  # type: ignore[index]
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, len(text).to_bytes(8, "little") + text, 0)
        os.ftruncate(self.fd, self.base + offset)

    def write(self, name: str, at: int, values: torch.Tensor) -> None:
        """`values`' bytes at byte `at` of array `name`."""
        data = values.contiguous().view(torch.uint8).numpy().tobytes()
        os.pwrite(self.fd, data, self.base + self.offsets[name] + at)

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


def map_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, list[int]], list[str]]:
    """The arrays of a safetensors file as tensors over one copy-on-write memory map (no
    copy; pages load when touched), the packed layers' [bits, scheme, rows, columns], and
    the conversion's notes."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    metadata = header.pop("__metadata__")
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        raw = torch.from_numpy(mapped[base + start : base + end])
        tensors[name] = raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors, json.loads(metadata["layers"]), json.loads(metadata["notes"])


def _packed(tensors: dict[str, torch.Tensor], name: str, layer: list[int]) -> PackedWeight:
    bits, scheme, rows, _ = layer
    empty = torch.empty(0, dtype=torch.float16)
    return PackedWeight(
        tensors[f"{name}.codes"], tensors[f"{name}.scales"], tensors.get(f"{name}.offsets", empty),
        bits, rows, scheme, tensors.get(f"{name}.sub", torch.empty(0, dtype=torch.uint8)),
    )  # fmt: skip


def _place(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    layers: dict[str, list[int]],
    dtype: torch.dtype,
    kernel_rows: int | None,
) -> None:
    """Set every stored parameter and layer (with its input order, where stored) into
    `model`; a head tied to its embedding takes the embedding's table (an untied
    embedding's table is never called as a linear, so it keeps no dense copy, whatever
    `kernel_rows`)."""
    modules = dict(model.named_modules())
    for name, tensor in tensors.items():
        if name.rpartition(".")[0] not in layers and name not in layers:
            module_name, _, attribute = name.rpartition(".")
            parameter = nn.Parameter(tensor.to(dtype), requires_grad=False)
            setattr(modules[module_name], attribute, parameter)
    head = model.get_output_embeddings()
    tied = (
        head is not None and head.weight.is_meta and f"{_name(modules, head)}.weight" not in layers
    )
    for name, layer in layers.items():
        module_name = name.rpartition(".")[0]
        parent_name, _, child = module_name.rpartition(".")
        module = modules[module_name]
        embedding = isinstance(module, nn.Embedding)
        rows = kernel_rows if tied or not embedding else None
        order = tensors.get(f"{name}.order")
        linear = QuantizedLinear(
            _packed(tensors, name, layer), getattr(module, "bias", None), rows, dtype,
            None if order is None else order.long(),
        )  # fmt: skip
        replacement = (
            QuantizedEmbedding(linear, dtype, getattr(module, "embed_scale", None))
            if embedding
            else linear
        )
        setattr(modules[parent_name] if parent_name else model, child, replacement)
    table = model.get_input_embeddings()
    if tied and isinstance(table, QuantizedEmbedding):
        model.set_output_embeddings(table.table)
    elif tied:
        head.weight = table.weight


def _name(modules: dict[str, nn.Module], module: nn.Module) -> str:
    return next(name for name, candidate in modules.items() if candidate is module)
