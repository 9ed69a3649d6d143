"""How a target of `engine.first_use.build_once` shows that it is whole.

A target is damaged after it was made when a file was truncated (a full disk, a killed
copy) or deleted; a truncated library kills the process that loads it (SIGBUS), so the
damage must be found before. Each build records every file's size in a manifest
(`MANIFEST`, written last into the staging folder), checked at every use (a `stat` per
file); and the headers of `.safetensors` files and of `.so` libraries must account for
their sizes, which covers targets made before manifests were too. Contents are not
checksummed: a check at every start would read every byte (the default model's 540 MB).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from pathlib import Path

# Written last into a target: each of its files' size when it was made.
MANIFEST = ".pagedserve-manifest.json"


def damage(target: Path) -> str | None:
    """What the manifest or a safetensors header shows damaged in `target`, or None."""
    manifest = target / MANIFEST
    if manifest.exists():  # a target without one: the headers alone are checked
        try:
            sizes = json.loads(manifest.read_text())["sizes"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"is damaged: its {MANIFEST} cannot be read"
        for name, size in sizes.items():
            try:
                actual = (target / name).stat().st_size
            except OSError:
                return f"is damaged: {name} is missing"
            if actual != size:
                return f"is damaged: {name} is {actual} bytes, but was {size} when it was made"
    for path in sorted(target.glob("*.safetensors")):
        described = _safetensors_size(path)
        actual = path.stat().st_size
        if described != actual:
            what = "an unreadable header" if described is None else f"{described} bytes"
            return f"is damaged: {path.name} is {actual} bytes, but its header describes {what}"
    for path in sorted(target.glob("*.so")):
        described = _elf_size(path)
        actual = path.stat().st_size
        if described is not None and described > actual:
            return f"is damaged: {path.name} is {actual} bytes, but its headers need {described}"
    return None


def _safetensors_size(path: Path) -> int | None:
    """The size a safetensors file's header describes (header and every tensor's data), or
    None if the header cannot be read."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > 100_000_000:
                return None
            header = json.loads(file.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return None
    return 8 + length + max(ends, default=0)


def _elf_size(path: Path) -> int | None:
    """The least size a 64-bit little-endian ELF file's headers say it has (the ends of its
    header tables and of its loaded segments), or None for any other file: a truncated
    library is mapped beyond its end by the dynamic loader, which kills the process with
    SIGBUS, not an ImportError."""
    try:
        with path.open("rb") as file:
            header = file.read(64)
            if len(header) < 64 or header[:6] != b"\x7fELF\x02\x01":
                return None
            (phoff, shoff) = struct.unpack_from("<QQ", header, 32)
            (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", header, 54)
            ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
            file.seek(phoff)
            table = file.read(phentsize * phnum)
            for i in range(phnum if len(table) == phentsize * phnum else 0):
                offset, filesz = struct.unpack_from("<Q16xQ", table, i * phentsize + 8)
                ends.append(offset + filesz)
    except (OSError, struct.error):
        return None
    return max(ends)


def write_manifest(staging: Path, rewritten: Collection[str]) -> None:
    """Record the size of every file in `staging`, but those of `rewritten` (paths its
    users rewrite later)."""
    files = (path for path in sorted(staging.rglob("*")) if path.is_file())
    sizes = {path.relative_to(staging).as_posix(): path.stat().st_size for path in files}
    for name in rewritten:
        sizes.pop(name, None)
    (staging / MANIFEST).write_text(json.dumps({"sizes": sizes}, indent=1) + "\n")
