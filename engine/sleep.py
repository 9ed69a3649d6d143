"""Sleep: giving a loaded model's memory back to the machine while it idles, on the CPU.

Level 1 releases the KV cache's pages; level 2 also the pages of the weights that are
memory-mapped from files (a GGUF's or the quantized store's converted tensors). Nothing is
freed as an object: the tensors keep their addresses, so the runner, the compiled forward
and the kernels' registered layers stay valid, and waking takes no work at all.

- The KV tensor is anonymous memory: `madvise(MADV_DONTNEED)` over the page-aligned inside of
  its storage returns those pages, and the kernel maps zero pages in as they are touched
  again: a KV tensor as `allocate_kv_cache` makes it. What the pages held is lost, so the
  prefix cache must be forgotten first (`LLMEngine.sleep`).
- A weight mapping is released only if it is a private or shared mapping of a file in which
  no page was ever written (`Anonymous: 0 kB` in /proc/self/smaps): its pages are then
  exactly the file's, and are read back from it (usually still in the page cache) as they
  are touched. A mapping with written pages is left alone, and weights in anonymous memory
  (converted at start-up, not mapped) stay resident: releasing those would lose them.

Linux only (madvise through libc, /proc/self); elsewhere `supported()` is False.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import mmap
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

from engine.heap import LIBC

MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What a sleep gave back: the level, the fall of this process's resident set in bytes,
    and the seconds it took."""

    level: int
    released_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Mapping:
    """One line of /proc/self/maps: [start, end), and the file it maps ('' if none)."""

    start: int
    end: int
    path: str


def supported() -> bool:
    """Whether this process can release pages (Linux, with a libc madvise)."""
    return sys.platform.startswith("linux") and Path("/proc/self/smaps").exists()


def resident_bytes() -> int:
    """This process's resident set in bytes."""
    return psutil.Process().memory_info().rss


def release_tensor(tensor: torch.Tensor) -> None:
    """Return the pages inside `tensor`'s storage (a CPU tensor in anonymous memory) to the
    system; they read as zeros when touched again. The partial pages at either end stay."""
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // PAGE) * PAGE
    end = (storage.data_ptr() + storage.nbytes()) // PAGE * PAGE
    if end > start:
        _madvise(start, end - start)


def weight_mappings(model: nn.Module) -> list[Mapping]:
    """The file mappings that hold `model`'s tensors and in which no page was ever written,
    each once."""
    maps = _maps()
    starts = [mapping.start for mapping in maps]
    found: dict[int, Mapping] = {}
    for tensor in _tensors(model):
        if tensor.device.type != "cpu" or tensor.nbytes == 0:
            continue
        at = bisect.bisect_right(starts, tensor.data_ptr()) - 1
        if at >= 0 and maps[at].path.startswith("/") and tensor.data_ptr() < maps[at].end:
            found[maps[at].start] = maps[at]
    clean = _unwritten({mapping.start for mapping in found.values()})
    return [mapping for start, mapping in sorted(found.items()) if start in clean]


def release_mappings(mappings: list[Mapping]) -> None:
    """Drop the pages of file mappings found by `weight_mappings`; they are read back from
    their files when touched again."""
    for mapping in mappings:
        _madvise(mapping.start, mapping.end - mapping.start)


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a module of `model` holds: parameters, buffers, and tensors held as
    attributes or in dataclass attributes (a quantized layer's packed weight)."""
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        for value in vars(module).values():
            yield from _held_tensors(value)


def _held_tensors(value: object) -> Iterator[torch.Tensor]:
    """`value` if it is a tensor, a dataclass instance's tensor fields, else nothing."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if isinstance(item, torch.Tensor):
                yield item


def _maps() -> list[Mapping]:
    """This process's mappings, by start address."""
    mappings = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(value, 16) for value in parts[0].split("-"))
        mappings.append(Mapping(start, end, parts[5] if len(parts) == 6 else ""))
    return sorted(mappings, key=lambda mapping: mapping.start)


def _unwritten(starts: set[int]) -> set[int]:
    """Those of the mappings starting at `starts` that hold no anonymous (written) page."""
    clean, start = set(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            begin = int(head.split("-")[0], 16)
            start = begin if begin in starts else None
        elif start is not None and head == "Anonymous:" and int(line.split()[1]) == 0:
            clean.add(start)
    return clean


def _madvise(address: int, length: int) -> None:
    if LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({address:#x}, {length}) failed")
