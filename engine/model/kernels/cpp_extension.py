"""The project's C++ kernels: each source built once per machine, loaded on first use.

A `CppExtension` compiles one `.cpp` file with torch's JIT extension builder (ninja and the
system C++ compiler) into `$PAGEDSERVE_CACHE/kernels/<name>-<tag>`. The tag hashes the
torch and Python versions and the CPU's feature flags, because the library is linked
against torch's ABI and built with `-march=native`, and the source, the headers it
includes with quotes (`#include "amx_tiles.h"`, found next to the file that includes
them) and the flags, so that a header's change rebuilds every kernel that includes it and
checkouts of different versions keep a library each. A first build takes 30 to 50 s on a
2-core CPU; later processes load the library directly, without compiler or ninja, when
the folder's stamp shows it was built from this very source, headers and flags: a container
image can carry libraries built in its builder stage. A failed build is logged once and
reported as `KernelUnavailableError`, so callers keep their torch path.

Invariants: each extension's build is tried at most once per process; every later call
returns the same module or raises the same failure. Across processes the build is
`engine.first_use.build_once`'s: processes starting together build a kernel once and
the others load that library; a build killed mid-way leaves only its staging folder,
which the next build deletes (with torch's own lock file in it, which torch's builder
would otherwise wait on forever).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import platform
import re
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from engine.config import cache_root
from engine.first_use import build_once

logger = logging.getLogger(__name__)

# Written next to the library after a build: the digest of the sources and flags it holds.
STAMP_NAME = "source.sha256"
# -Wno-psabi: without AVX-512, GCC warns that 64-byte vectors change the calling convention;
# they never cross a function boundary outside one source file.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-Wall", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
# A project header: `#include "name.h"` (system headers use <...>).
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class KernelUnavailableError(RuntimeError):
    """A C++ kernel could not be built or loaded here; the message says why."""


class CppExtension:
    """The library built from `source` (a `.cpp` file next to this module) as the Python
    module `pagedserve_<name>`."""

    def __init__(self, name: str, source: Path) -> None:
        self.name = name
        self.source = source
        self.module_name = f"pagedserve_{name}"
        self.library_name = f"{self.module_name}.so"
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
        """Where the library is built: one folder per source, flags, torch, Python and CPU
        combination, so that two checkouts (or versions) on one machine never rebuild each
        other's library at every start."""
        fingerprint = "|".join(
            (torch.__version__, sys.version, platform.machine(), cpu_flags(), self._source_digest())
        )
        tag = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
        return cache_root() / "kernels" / f"{self.name}-{tag}"

    def _build(self) -> ModuleType:
        directory = self.build_directory()
        if not self._is_built(directory):
            _check_toolchain()
        built = build_once(
            directory,
            self._compile,
            complete=self._is_built,
            doing=f"building the C++ {self.name} kernel",
            expected="about 40 s",
            done="built",
        )
        # The process that built the library has loaded it (from the staging folder, now
        # renamed): loading it again would register its torch ops twice.
        return built if built is not None else self._load_built(directory)

    def _compile(self, staging: Path) -> ModuleType:
        """Build and load the library in the empty folder `staging`, stamped."""
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=self.module_name,
            sources=[str(self.source)],
            extra_cflags=list(CFLAGS),  # copies: torch appends to the lists it is given
            extra_ldflags=list(LDFLAGS),
            build_directory=str(staging),
        )
        (staging / STAMP_NAME).write_text(self._source_digest())
        return module

    def _is_built(self, directory: Path) -> bool:
        """Whether `directory` holds the library built from this source and these flags."""
        try:
            stamp = (directory / STAMP_NAME).read_text()
        except OSError:
            return False
        return stamp == self._source_digest() and (directory / self.library_name).is_file()

    def _load_built(self, directory: Path) -> ModuleType:
        library = directory / self.library_name
        spec = importlib.util.spec_from_file_location(self.module_name, library)
        if spec is None or spec.loader is None:
            raise KernelUnavailableError(f"cannot load {library}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        logger.info("loaded the C++ %s kernel from %s", self.name, library)
        return module

    def sources(self) -> list[Path]:
        """The source, then every header it includes with quotes, transitively, each once
        in the order first met; a header is looked for next to the file that includes it."""
        found, pending = [self.source], [self.source]
        while pending:
            including = pending.pop(0)
            for name in _QUOTED_INCLUDE.findall(including.read_text()):
                header = (including.parent / name).resolve()
                if header not in found:
                    found.append(header)
                    pending.append(header)
        return found

    def _source_digest(self) -> str:
        digest = hashlib.sha256()
        for path in self.sources():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        digest.update(" ".join(CFLAGS + LDFLAGS).encode())
        return digest.hexdigest()


def _check_toolchain() -> None:
    """Raise `KernelUnavailableError` where torch's builder lacks its compiler or ninja."""
    from torch.utils import cpp_extension  # imports setuptools: only once a build is needed

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise KernelUnavailableError(f"no C++ compiler '{compiler}' on PATH (set CXX)")
    if not cpp_extension.is_ninja_available():
        raise KernelUnavailableError("ninja is not installed (pip install ninja)")


def cpu_flags() -> str:
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
