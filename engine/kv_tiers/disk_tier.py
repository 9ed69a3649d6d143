"""The disk tier under the prefix cache: every full prefix block, once its KV is written,
is also written to a file of its own, and a prefix lookup that stops in memory goes on
among the files; least recently used files are deleted beyond the budget.

Files live in `<kv_disk_path>/<key>/`, the key a hash of everything that changes a
block's bits (`tier_key`): another model or setting has another folder and never reads
these. A file is named by its block's chained hash (`block_file.file_name`), written
under a temporary name and renamed, so a reader sees it whole or not at all, and checked
whole on every read (`block_file.read_into`); one that fails is deleted with one log line
and its block computed. The index (hash -> nothing, oldest use first) is rebuilt at start
from the folder's names and modification times, without reading a file; a load touches
its files, so the order survives restarts.

Several servers may share a folder: each writes only whole files under names that no
other content can have, and when one finds the folder over its budget it rescans it and
deletes the least recently used files of all (down to 90% of the budget, so rescans stay
rare). A server killed while writing leaves at most a temporary file, which no reader
trusts and which a later start deletes once it is old.

Threads: the engine's thread calls `lookup`, `store` (which copies the blocks' KV out
at once), `start_loads` and `finish_loads` (which copies finished loads in); a writer
thread writes and deletes files, and publishes their events as it does (so they go out
while the engine idles too), a loader thread reads and checks them. The index and the
counters are shared under one lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import transformers

from cache import MEDIUM_DISK, BlockRemoved, RegisteredBlock, stored_events
from engine.kv_tier import Publish, TierStats
from engine.kv_tiers.block_copy import BlockCopier
from engine.kv_tiers.block_file import (
    FORMAT,
    BlockFileError,
    block_hash_of,
    encode,
    file_name,
    file_size,
    read_into,
)
from engine.model.gguf import file_key
from engine.model.kernels.cpp_extension import cpu_flags
from scheduler import ExpectedBlock, TierLoad

logger = logging.getLogger(__name__)

# A load for the loader: what each of its blocks must hold, and when it started.
_Read = tuple[TierLoad, list[ExpectedBlock], float]

# A temporary file older than this was left by a killed writer: a start deletes it.
STALE_SECONDS = 600.0
# KV copied out and waiting for the writer, at most; beyond it stores are skipped.
MAX_QUEUED_BYTES = 512 << 20
# Eviction deletes down to this share of the budget.
LOW_WATER = 0.9
# The writer rescans the folder after a write at least this often (others' files count).
RESCAN_SECONDS = 1.0
# The writer's nice value: it takes idle CPU, not the engine's.
WRITER_NICE = 10


def model_files(source: Path) -> str:
    """The identity of a model's files: each one's `file_key` (path, size, modification
    time); a hub id that is no local path stands for itself."""
    if not source.exists():
        return str(source)
    paths = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    return "|".join(file_key(path) for path in paths)


def tier_key(settings: Mapping[str, str], source: Path) -> str:
    """The folder name for blocks computed by this model's files with these settings
    (quantization, dtype, block size, KV layout, step path...), this format, and the
    torch, transformers, Python and CPU they were computed with."""
    parts = dict(settings)
    parts.update(
        model_files=model_files(source), format=str(FORMAT), torch=torch.__version__,
        transformers=transformers.__version__, python=sys.version, cpu=cpu_flags(),
    )  # fmt: skip
    digest = hashlib.sha256()
    for name in sorted(parts):
        digest.update(f"{name}={parts[name]}\0".encode())
    return digest.hexdigest()[:16]


class DiskTier:
    """A `KVTier` (engine/kv_tier.py) of block files in one folder, within `capacity` bytes.

    Invariants: `_index` holds the hashes of the files this process believes exist, in
    order of last use; `len(_index) * _file_bytes` is the space they take (every file of
    a folder has one size). A hash is in `_writing` from `store` until its file is written
    or given up, so a block is queued once. `_pending` counts loads started and not yet
    returned by `finish_loads`.
    """

    medium = MEDIUM_DISK

    def __init__(
        self, kv_caches: tuple[torch.Tensor, ...], capacity: int, root: Path, key: str,
        block_size: int, publish: Publish | None = None,
    ) -> None:  # fmt: skip
        self._copier = BlockCopier(kv_caches)
        self.key = key
        self.block_size = block_size
        self.folder = root / key
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file_bytes = file_size(block_size, self._copier.block_bytes)
        self.capacity = capacity
        self._max_files = capacity // self._file_bytes
        if self._max_files < 1:
            raise ValueError(
                f"kv_disk_size {capacity} B holds no block: one takes {self._file_bytes} B"
            )
        self._lock = threading.Lock()
        self._index: OrderedDict[int, None] = OrderedDict()
        self._writing: set[int] = set()
        self._queued_bytes = 0
        self._publish = publish
        self._stores = self._loads = self._drops = self._load_count = 0
        self._behind = False  # the writer fell behind: logged once
        self._load_seconds = 0.0
        self._pending = 0
        self._scan()
        self._writes: queue.SimpleQueue[tuple[list[RegisteredBlock], torch.Tensor] | None]
        self._writes = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[TierLoad, torch.Tensor, int, float]]
        self._done = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._loader = threading.Thread(target=self._read_loop, name="kv-disk-loader", daemon=True)
        self._writer.start()
        self._loader.start()

    # -- the engine's thread --------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks have files: known ones, or ones another server wrote
        since the last scan (one `stat` each)."""
        found = 0
        with self._lock:
            for block_hash in block_hashes:
                if block_hash not in self._index:
                    if not (self.folder / file_name(block_hash)).exists():
                        break
                    self._index[block_hash] = None
                found += 1
        return found

    def store(self, blocks: Sequence[RegisteredBlock]) -> None:
        with self._lock:
            todo = [
                block
                for block in blocks
                if block.block_hash not in self._index and block.block_hash not in self._writing
            ]
            size = len(todo) * self._copier.block_bytes
            if not todo:
                return
            if self._queued_bytes + size > MAX_QUEUED_BYTES:
                if not self._behind:
                    self._behind = True
                    logger.warning(
                        "KV disk tier: the disk is slower than the KV computed; blocks are "
                        "left out while %d MiB wait to be written",
                        MAX_QUEUED_BYTES >> 20,
                    )
                return
            self._writing.update(block.block_hash for block in todo)
            self._queued_bytes += size
        self._writes.put((todo, self._copier.gather([block.block_id for block in todo])))

    def start_loads(self, loads: Sequence[TierLoad]) -> None:
        now = time.monotonic()
        for load in loads:
            self._pending += 1
            self._reads.put((load, load.expected_blocks(self.block_size), now))

    def finish_loads(self, wait: float = 0.0) -> list[tuple[TierLoad, int]]:
        finished = []
        if self._pending and wait > 0 and self._done.empty():
            with contextlib.suppress(queue.Empty):
                finished.append(self._done.get(timeout=wait))
        while not self._done.empty():
            finished.append(self._done.get_nowait())
        applied = []
        for load, host, num_blocks, seconds in finished:
            self._pending -= 1
            if not load.current:
                num_blocks = 0
            self._copier.scatter(load.block_ids[:num_blocks], host)
            with self._lock:
                self._loads += num_blocks
                self._load_count += 1
                self._load_seconds += seconds
            applied.append((load, num_blocks))
        return applied

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                medium=self.medium, path=str(self.folder),
                bytes_used=len(self._index) * self._file_bytes, capacity=self.capacity,
                num_blocks=len(self._index), stores=self._stores, loads=self._loads,
                drops=self._drops, load_count=self._load_count, load_seconds=self._load_seconds,
            )  # fmt: skip

    def close(self, timeout: float = 30.0) -> None:
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._loader.join(timeout)

    # -- the writer's thread --------------------------------------------------------

    def _write_loop(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # no per-thread priority here
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while (item := self._writes.get()) is not None:
            blocks, data = item
            written = []
            for block, kv in zip(blocks, data, strict=True):
                try:
                    self._write(block, kv)
                except OSError as exc:  # a full disk, a folder removed: the block stays out
                    logger.warning("KV disk tier: cannot write a block (%s)", exc)
                else:
                    written.append(block)
            with self._lock:
                for block in blocks:
                    self._writing.discard(block.block_hash)
                for block in written:
                    self._index[block.block_hash] = None
                self._queued_bytes -= len(blocks) * self._copier.block_bytes
                self._stores += len(written)
                over = len(self._index) > self._max_files
            if written and self._publish is not None:
                self._publish(stored_events(written, self.block_size, self.medium))
            if over or time.monotonic() - self._scanned_at > RESCAN_SECONDS:
                self._evict()

    def _write(self, block: RegisteredBlock, kv: torch.Tensor) -> None:
        path = self.folder / file_name(block.block_hash)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        payload = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        parts = encode(self.key, block.block_hash, block.parent_hash, block.token_ids, payload)
        try:
            with temporary.open("wb") as file:
                for part in parts:
                    file.write(part)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    def _evict(self) -> None:
        """Rescan the folder (other servers' files count against the budget too), then, if
        it is over budget, delete the least recently used files down to `LOW_WATER` of it."""
        self._scan()
        with self._lock:
            if len(self._index) <= self._max_files:
                return
            excess = len(self._index) - int(self._max_files * LOW_WATER)
            victims = [self._index.popitem(last=False)[0] for _ in range(max(excess, 0))]
        for block_hash in victims:
            (self.folder / file_name(block_hash)).unlink(missing_ok=True)
        if victims and self._publish is not None:
            self._publish([BlockRemoved(tuple(victims), self.medium)])

    def _scan(self) -> None:
        """Rebuild the index from the folder's names and modification times (no file is
        read), deleting temporary files old enough to be a killed writer's."""
        found = []
        now = time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    block_hash = block_hash_of(entry.name)
                    if block_hash is not None:
                        found.append((entry.stat().st_mtime_ns, block_hash))
                    elif (
                        entry.name.endswith(".tmp") and now - entry.stat().st_mtime > STALE_SECONDS
                    ):
                        os.unlink(entry.path)
        found.sort()
        with self._lock:
            self._index = OrderedDict((block_hash, None) for _, block_hash in found)
        self._scanned_at = time.monotonic()

    # -- the loader's thread --------------------------------------------------------

    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            load, expected, started = job
            host = self._copier.host_buffer(len(expected))
            num_read = 0
            try:
                for block, out in zip(expected, host, strict=True):
                    if not self._read(block, out):
                        break
                    num_read += 1
            except Exception:  # a bug here must not leave the sequence waiting forever
                logger.exception("KV disk tier: a load failed; computing its blocks")
            self._done.put((load, host, num_read, time.monotonic() - started))

    def _read(self, block: ExpectedBlock, out: torch.Tensor) -> bool:
        """Read one block's file into `out`; False (the file dropped if damaged) if not."""
        block_hash = block.block_hash
        path = self.folder / file_name(block_hash)
        try:
            into = memoryview(out.view(torch.uint8).numpy()).cast("B")
            read_into(path, self.key, block_hash, block.parent_hash, block.token_ids, into)
        except FileNotFoundError:
            with self._lock:
                self._index.pop(block_hash, None)
            return False
        except (BlockFileError, OSError) as exc:
            logger.warning("KV disk tier: dropped %s (%s); computing it again", path, exc)
            path.unlink(missing_ok=True)
            with self._lock:
                self._index.pop(block_hash, None)
                self._drops += 1
            return False
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order, kept across restarts
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return True
