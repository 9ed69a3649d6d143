"""The project's C++ kernels: each source built once per machine, loaded on first use.

A `CppExtension` compiles one `.cpp` file with torch's JIT extension builder (ninja and the
system C++ compiler) into `$PAGEDSERVE_CACHE/kernels/<name>-<tag>`. The tag hashes the
torch and Python versions and the CPU's feature flags, because the library is linked
against torch's ABI and built with `-march=native`. A first build takes about a minute;
later processes load the library directly, without compiler or ninja, when the folder's
stamp shows it was built from this very source and these flags: a container image can
carry libraries built in its builder stage. A failed build is logged once and reported
as `KernelUnavailableError`, so callers keep their torch path.

Invariant: each extension's build is tried at most once per process; every later call
returns the same module or raises the same failure.
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
from pathlib import Path
from types import ModuleType

import torch

from engine.config import cache_root

logger = logging.getLogger(__name__)

# Written next to the library after a build: the digest of the source and flags it holds.
STAMP_NAME = "source.sha256"
# -Wno-psabi: without AVX-512, GCC warns that 64-byte vectors change the calling convention;
# they never cross a function boundary outside one source file.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-Wall", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
# torch's build lock is a file that a killed build leaves behind, and later builds would
# wait for it forever; a build takes about a minute, so an older lock is such a leftover.
STALE_LOCK_SECONDS = 600


class KernelUnavailableError(RuntimeError):
    """A C++ kernel could not be built or loaded here; the message says why."""


class CppExtension:
    """The library built from `source` (a `.cpp` file next to this module) as the Python
    module `pagedserve_<name>`."""

    def __init__(self, name: str, source: Path) -> None:
        self.name = name
        self.source = source
        self.module_name = f"pagedserve_{name}"
        self._lock = threading.Lock()
        # None: not tried yet; a module: built and loaded; an exception: why it failed.
        self._result: ModuleType | Exception | None = None

    def load(self) -> ModuleType:
        """The loaded module, built first if needed. Thread-safe; a failure is logged
        once, as a warning, and raised as `KernelUnavailableError` at every call. Once
        loaded, a call takes no lock (kernels call this at every use)."""
        if isinstance(self._result, ModuleType):
            return self._result
        with self._lock:
            if self._result is None:
                try:
                    self._result = self._build()
                except Exception as exc:  # a broken toolchain fails in many ways; all mean "no"
                    self._result = exc
                    logger.warning(
                        "C++ %s kernel unavailable, torch is used instead: %s",
                        self.name,
                        _describe(exc),
                    )
            if isinstance(self._result, Exception):
                raise KernelUnavailableError(_describe(self._result)) from self._result
            return self._result

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot be built or loaded here, or None if it can (tries the
        build if no call has yet)."""
        try:
            self.load()
        except KernelUnavailableError as exc:
            return str(exc)
        return None

    def build_directory(self) -> Path:
        """Where the library is built: one folder per torch, Python and CPU combination."""
        fingerprint = "|".join((torch.__version__, sys.version, platform.machine(), _cpu_flags()))
        tag = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
        return cache_root() / "kernels" / f"{self.name}-{tag}"

    def _build(self) -> ModuleType:
        directory = self.build_directory()
        prebuilt = self._load_prebuilt(directory)
        if prebuilt is not None:
            return prebuilt
        from torch.utils import cpp_extension  # imports setuptools: only once a build is needed

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
            "loading the %s kernel from %s (a first build takes a minute)", self.name, directory
        )
        module = cpp_extension.load(
            name=self.module_name,
            sources=[str(self.source)],
            extra_cflags=list(CFLAGS),  # copies: torch appends to the lists it is given
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
        )
        (directory / STAMP_NAME).write_text(self._source_digest())
        return module

    def _load_prebuilt(self, directory: Path) -> ModuleType | None:
        """The library in `directory` if its stamp matches this source and these flags."""
        library = directory / f"{self.module_name}.so"
        try:
            stamp = (directory / STAMP_NAME).read_text()
        except OSError:
            return None
        if stamp != self._source_digest() or not library.is_file():
            return None
        spec = importlib.util.spec_from_file_location(self.module_name, library)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        logger.info("loaded the prebuilt %s kernel from %s", self.name, library)
        return module

    def _source_digest(self) -> str:
        flags = " ".join(CFLAGS + LDFLAGS).encode()
        return hashlib.sha256(self.source.read_bytes() + b"\0" + flags).hexdigest()


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
