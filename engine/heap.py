"""The process's C heap (glibc's malloc), which holds every CPU tensor torch allocates.

A forward allocates its activations afresh at every step and frees them at its end. By
default glibc serves a block of more than 128 KiB (a threshold it raises, up to 32 MiB, as
such blocks are freed) with a fresh `mmap`, unmapped again on free, and hands the free top
of a heap back to the kernel once it passes twice that threshold; so the pages of a step's
activations went back to the kernel after each step and the next step faulted them in
again, each zero-filled (an all-MiniLM-L6-v2 server took 594,000 page faults embedding
128 texts three ways). `keep_freed_memory` keeps blocks up to 32 MiB in the heap and up to
256 MiB of free memory at its top, so steps reuse their pages (67,000 faults; see
`docs/operations.md`).

Invariants: after `keep_freed_memory` a heap holds at most `KEEP_FREE` bytes of free
memory at its top (per arena: in practice the torch thread's); `trim_heap` hands every
free page back (after loading or unloading a model). Where the C library is not glibc,
both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap, not from mmap: glibc's largest allowed value.
MMAP_THRESHOLD = 32 << 20
# The free memory a heap keeps at its top before handing it back.
KEEP_FREE = 256 << 20

# The C library, with errno kept for callers that check it (`sleep.py`'s madvise).
LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def keep_freed_memory() -> None:
    """Keep blocks of up to `MMAP_THRESHOLD` bytes in the heap and up to `KEEP_FREE` bytes
    of free memory at a heap's top, for the whole process (idempotent)."""
    mallopt = getattr(LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, KEEP_FREE)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the machine (glibc's `malloc_trim`), in every
    arena, whatever `KEEP_FREE` says."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(ctypes.c_size_t(0))
