"""First-use work under the cache (a converted model, a built kernel), safe to race.

`build_once(target, build, ...)` makes the folder `target` with `build` unless it is
complete already: it checks the target, else takes an exclusive `flock` on a lock file
next to it (`.<name>.lock`), checks again (a process that held the lock may have just
made it: then it is adopted), else builds into a staging folder next to it
(`.<name>.partial-<pid>`) and renames that into place. `locked(target, doing)` is the lock
alone, for work that makes its result some other way.

Invariant: any number of processes starting at once on an empty cache do the work once,
and all adopt the one result. A process killed mid-way leaves no lock behind (the kernel
drops an `flock` when its holder dies, however it dies) and no half result: only the
lock's holder writes a staging folder, so the next holder deletes what killed ones left,
and the target appears whole or not at all. A process that finds the target complete
takes no lock, so a read-only cache holding everything already works.

A target damaged after it was made (a file truncated by a full disk or a killed copy, or
deleted) is made again, with a warning that says what was wrong, rather than failing deep
inside whatever loads it (a truncated library kills the process that loads it: SIGBUS).
Each build records every file's size in a manifest (`.pagedserve-manifest.json`, written
last into the staging folder), checked at every use (a `stat` per file); and the headers
of `.safetensors` files and of `.so` libraries must account for their sizes, which covers
targets made before manifests were too. Contents are not checksummed: a check at every
start would read every byte (the default model's 540 MB).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Written last into a target: each of its files' size when it was made.
MANIFEST = ".pagedserve-manifest.json"


@contextmanager
def locked(target: Path, doing: str) -> Iterator[None]:
    """Hold the exclusive lock on `target` for the block, waiting for another process
    that holds it (logged once, with its pid and `doing`, e.g. "converting x.gguf")."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 20, 0).decode(errors="replace").strip() or "?"
            logger.info("waiting for another process (pid %s) %s...", holder, doing)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # for the next waiter's message
        yield
    finally:
        os.close(fd)  # releases the lock


def build_once(
    target: Path,
    build: Callable[[Path], T],
    *,
    complete: Callable[[Path], bool],
    doing: str,
    expected: str,
    done: str,
    rewritten: Collection[str] = (),
) -> T | None:
    """Make `target` by calling `build(staging)` on an empty folder, unless it is whole:
    `complete(target)` and undamaged (see the module's docstring).

    Returns what `build` returned if this process built the target, or None if it was
    whole already or another process completed it while this one waited. Logs
    "<doing> once into <target> (<expected>)" before the work and "<done> in <s> s" after
    it. A target that exists but is incomplete (an interrupted build, an older layout) or
    damaged is replaced, with a warning saying why. `rewritten`: the paths (relative to
    the target) of files its users rewrite later, whose size is not checked.
    """
    if _problem(target, complete) is None:
        return None
    with locked(target, doing):
        problem = _problem(target, complete)
        if problem is None:
            logger.info("another process made %s: using it", target)
            return None
        if target.exists():
            logger.warning("%s %s: making it again", target, problem)
        partial = f".{target.name}.partial-"
        for leftover in target.parent.iterdir():  # what killed holders left
            if leftover.name.startswith(partial):
                logger.info("removing %s, left by a build that was interrupted", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        # Named by pid: a killed builder's orphaned children (a compiler) write into a
        # folder that is gone, not into this one.
        staging = target.with_name(f"{partial}{os.getpid()}")
        staging.mkdir()
        logger.info("%s once into %s (%s)", doing, target, expected)
        start = time.monotonic()
        try:
            result = build(staging)
            _write_manifest(staging, rewritten)
            if target.exists():
                # Aside first, so that the target is never seen half deleted.
                old = staging.with_name(f"{staging.name}-old")
                os.replace(target, old)
                os.replace(staging, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("%s in %.1f s", done, time.monotonic() - start)
        return result


def _problem(target: Path, complete: Callable[[Path], bool]) -> str | None:
    """None if `target` is whole, else what is wrong with it (its own first words)."""
    if not target.is_dir():
        return "is missing"
    if not complete(target):
        return "is incomplete or out of date (a build that was interrupted, or an older one)"
    return _damage(target)


def _damage(target: Path) -> str | None:
    """What the manifest or a safetensors header shows damaged in `target`, or None."""
    manifest = target / MANIFEST
    if manifest.exists():  # else made before manifests were: the headers alone are checked
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


def _write_manifest(staging: Path, rewritten: Collection[str]) -> None:
    files = (path for path in sorted(staging.rglob("*")) if path.is_file())
    sizes = {path.relative_to(staging).as_posix(): path.stat().st_size for path in files}
    for name in rewritten:
        sizes.pop(name, None)
    (staging / MANIFEST).write_text(json.dumps({"sizes": sizes}, indent=1) + "\n")
