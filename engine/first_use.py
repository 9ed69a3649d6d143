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
inside whatever loads it (see `engine.first_use_manifest`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from engine.first_use_manifest import damage, write_manifest

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
            write_manifest(staging, rewritten)
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
    return damage(target)
