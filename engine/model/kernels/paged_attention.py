"""The C++ paged-attention kernel: built once per machine, loaded on first use.

`load_attention_kernel()` compiles `paged_attention.cpp` with torch's JIT extension
builder (ninja and the system C++ compiler) into
`$PAGEDSERVE_CACHE/kernels/paged_attention-<tag>`. The tag hashes the torch and Python
versions and the CPU's feature flags, because the library is linked against torch's ABI
and built with `-march=native`. The first build takes about a minute; later processes
load it directly, without compiler or ninja, when the folder's stamp shows it was built
from this very source and these flags: a container image can carry a library built in its
builder stage. A failed build is logged once and reported as `None`, so callers keep
their torch path.

Invariant: the build is tried at most once per process; every later call returns the
same function or the same failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from engine.config import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
EXTENSION_NAME = "pagedserve_paged_attention"
# Written next to the library after a build: the digest of the source and flags it holds.
STAMP_NAME = "source.sha256"
# -Wno-psabi: without AVX-512, GCC warns that 64-byte vectors change the calling convention;
# they never cross a function boundary outside this one file.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-Wall", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
# torch's build lock is a file that a killed build leaves behind, and later builds would
# wait for it forever; a build takes about a minute, so an older lock is such a leftover.
STALE_LOCK_SECONDS = 600

# (q, k_cache, v_cache, block_tables, query_start, context_lens, scale) -> out: see
# `paged_attention`; the torch implementations in engine.model.attention share it.
AttentionKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    torch.Tensor,
]

_lock = threading.Lock()
# None: not tried yet; a module: built and loaded; an exception: why the build failed.
_result: ModuleType | Exception | None = None


class KernelUnavailableError(RuntimeError):
    """The C++ kernel could not be built or loaded here; the message says why."""


def load_attention_kernel() -> AttentionKernel | None:
    """The kernel (see `paged_attention`), or None if it cannot be built here.

    Thread-safe. A failure is logged once, as a warning, when the build fails.
    """
    try:
        return _extension().paged_attention
    except KernelUnavailableError:
        return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built or loaded here, or None if it can (tries the build
    if no call has yet): for messages that say why attention stays on torch."""
    try:
        _extension()
    except KernelUnavailableError as exc:
        return str(exc)
    return None


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the kernel computes attention for tensors of this kind."""
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over a paged KV cache, on the CPU, without gathering K/V.

    q `[T, H, D]` packs the step's query rows sequence by sequence; k_cache, v_cache
    `[num_blocks, block_size, Hkv, D]`, contiguous, of q's dtype (see `supports`), with H a
    multiple of Hkv; block_tables `[B, max_blocks]` (int32 or int64) lists each sequence's
    blocks in order, and entries past its last used block are never read; query_start
    `[B + 1]` gives sequence b the rows `[query_start[b], query_start[b + 1])`, the last
    rows of its context of context_lens[b] tokens, each in `[1, max_blocks * block_size]`.
    Returns `[T, H, D]` in q's dtype: for a row at position p and head h,
    softmax(scale * q . K^T) V over positions 0..p of KV head h // (H // Hkv), in fp32.
    A row's bits depend only on its query, its position and its context's K/V (see the
    source's "Invariance"). Raises `KernelUnavailableError` if the kernel cannot be built
    and `RuntimeError` on inputs that break these invariants.
    """
    return _extension().paged_attention(
        q, k_cache, v_cache, block_tables, query_start, context_lens, scale
    )


def build_directory() -> Path:
    """Where the library is built: one folder per torch, Python and CPU combination."""
    fingerprint = "|".join((torch.__version__, sys.version, platform.machine(), _cpu_flags()))
    tag = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    return cache_root() / "kernels" / f"paged_attention-{tag}"


def _extension() -> ModuleType:
    global _result
    with _lock:
        if _result is None:
            try:
                _result = _build()
            except Exception as exc:  # a broken toolchain fails in many ways; all mean "no"
                _result = exc
                logger.warning(
                    "C++ paged attention kernel unavailable, attention stays on torch: %s",
                    _describe(exc),
                )
        if isinstance(_result, Exception):
            raise KernelUnavailableError(_describe(_result)) from _result
        return _result


def _build() -> ModuleType:
    directory = build_directory()
    prebuilt = _load_prebuilt(directory)
    if prebuilt is not None:
        return prebuilt
    from torch.utils import cpp_extension  # imports setuptools: only once the kernel is needed

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise KernelUnavailableError(f"no C++ compiler '{compiler}' on PATH (set CXX)")
    if not cpp_extension.is_ninja_available():
        raise KernelUnavailableError("ninja is not installed (pip install ninja)")
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):  # no lock: no build under way
        lock = directory / "lock"
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
    logger.info(
        "loading the paged attention kernel from %s (a first build takes a minute)", directory
    )
    module = cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),  # copies: torch appends to the lists it is given
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
    )
    (directory / STAMP_NAME).write_text(_source_digest())
    return module


def _load_prebuilt(directory: Path) -> ModuleType | None:
    """The library in `directory` if its stamp matches this source and these flags."""
    library = directory / f"{EXTENSION_NAME}.so"
    try:
        stamp = (directory / STAMP_NAME).read_text()
    except OSError:
        return None
    if stamp != _source_digest() or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    logger.info("loaded the prebuilt paged attention kernel from %s", library)
    return module


def _source_digest() -> str:
    flags = " ".join(CFLAGS + LDFLAGS).encode()
    return hashlib.sha256(SOURCE.read_bytes() + b"\0" + flags).hexdigest()


def _cpu_flags() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")


def _describe(exc: Exception) -> str:
    if isinstance(exc, KernelUnavailableError):
        return str(exc)
    # A failed build carries the whole compiler log; its first error names the cause.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["no message"]
    errors = [line for line in lines if "error:" in line]
    return f"{type(exc).__name__}: {(errors or lines)[0][:300]}"
