"""One KV block on disk: a header that names it, its tokens, its KV bytes, a checksum.

Layout (little-endian): magic `PSKV`, format version (u16), the tier's key (16 ASCII hex
digits: model, settings and format, see `disk_tier.tier_key`), the block's chained hash
(u64), its parent's (u64, and a u8 saying whether it has one), the number of tokens
(u32), the KV bytes' length (u64), then the xxh3-64 checksum (u64) of everything else in
the file: the header before it, the token ids (i64 each) and the KV bytes, which follow
it. A file is trusted only if every field matches what the reader expects and the
checksum matches: a truncated, overwritten or foreign file is refused, never served.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"PSKV"
FORMAT = 1
_HEAD = struct.Struct("<4sH16sQQBIQ")
_CHECKSUM = struct.Struct("<Q")
SUFFIX = ".kv"


class BlockFileError(ValueError):
    """A block file that cannot be trusted; the message says why."""


def file_name(block_hash: int) -> str:
    """The file of the block with chained hash `block_hash`: its 16 hex digits."""
    return f"{block_hash:016x}{SUFFIX}"


def block_hash_of(name: str) -> int | None:
    """The chained hash a block file's name gives, or None for any other name."""
    stem, dot, suffix = name.partition(".")
    if len(stem) != 16 or dot + suffix != SUFFIX:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def file_size(num_tokens: int, payload_bytes: int) -> int:
    return _HEAD.size + _CHECKSUM.size + 8 * num_tokens + payload_bytes


def encode(
    key: str, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
    payload: memoryview,
) -> list[bytes | memoryview]:  # fmt: skip
    """The file's parts in order (written one after another, the KV bytes not copied)."""
    head = _HEAD.pack(
        MAGIC, FORMAT, key.encode(), block_hash, parent_hash or 0, parent_hash is not None,
        len(token_ids), payload.nbytes,
    )  # fmt: skip
    tokens = np.asarray(token_ids, dtype="<i8").tobytes()
    digest = xxhash.xxh3_64(head)
    digest.update(tokens)
    digest.update(payload)
    return [head, _CHECKSUM.pack(digest.intdigest()), tokens, payload]


def read_into(
    path: Path, key: str, block_hash: int, parent_hash: int | None,
    token_ids: Sequence[int], out: memoryview,
) -> None:  # fmt: skip
    """Read the block file at `path` into `out` (exactly its KV bytes' length), checking
    that it is the block `block_hash` of this tier, after `parent_hash`, holding
    `token_ids`. Raises BlockFileError saying what is wrong (FileNotFoundError if gone)."""
    expected = file_size(len(token_ids), out.nbytes)
    with path.open("rb", buffering=0) as file:
        size = file.seek(0, 2)
        if size != expected:
            raise BlockFileError(f"{size} bytes, not {expected}")
        file.seek(0)
        head = file.read(_HEAD.size)
        (checksum,) = _CHECKSUM.unpack(file.read(_CHECKSUM.size))
        tokens = file.read(8 * len(token_ids))
        if file.readinto(out) != out.nbytes:
            raise BlockFileError("shorter than its header says")
    magic, version, file_key, stored_hash, parent, has_parent, num_tokens, payload = _HEAD.unpack(
        head
    )
    if magic != MAGIC or version != FORMAT or file_key != key.encode():
        raise BlockFileError("not a block of this tier (another model, setting or format)")
    digest = xxhash.xxh3_64(head)
    digest.update(tokens)
    digest.update(out)
    if digest.intdigest() != checksum:
        raise BlockFileError("checksum mismatch")
    stored_parent = parent if has_parent else None
    stored_tokens = np.frombuffer(tokens, dtype="<i8")
    if (
        stored_hash != block_hash
        or stored_parent != parent_hash
        or num_tokens != len(token_ids)
        or payload != out.nbytes
        or not np.array_equal(stored_tokens, np.asarray(token_ids, dtype=np.int64))
    ):
        raise BlockFileError("holds another block than its name says")
