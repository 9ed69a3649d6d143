"""The C++ kernels' sources are C++17, which torch 2.11's extension builder compiles with
(torch 2.13 uses C++20), and where no kernel can be built the engine keeps torch attention."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from engine.model.kernels import bf16_linear, group_linear, paged_attention
from engine.model.kernels.cpp_extension import CFLAGS, CppExtension

EXTENSIONS = [paged_attention.EXTENSION, group_linear.EXTENSION, bf16_linear.EXTENSION]


def cxx17_check(source: Path, module_name: str) -> subprocess.Popen[str]:
    """Compile `source` as torch's builder does, but under C++17, without code generation.

    torch's and Python's headers come in with -isystem, as the builder passes them, so
    -pedantic-errors (which turns C++20 extensions that GCC accepts under C++17 with only a
    warning into errors) judges our code alone: torch 2.13's headers compile as C++17, with
    such warnings and pedantic errors that -isystem silences."""
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler '{compiler}' on PATH (set CXX)")
    headers = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = [
        compiler, "-std=c++17", "-pedantic-errors", "-fsyntax-only", "-fPIC", *CFLAGS,
        f"-DTORCH_EXTENSION_NAME={module_name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *[flag for header in headers for flag in ("-isystem", header)], str(source),
    ]  # fmt: skip
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def check_as_cxx17(source: Path, module_name: str) -> tuple[int, str]:
    """`cxx17_check`'s exit code and error output."""
    process = cxx17_check(source, module_name)
    _, errors = process.communicate(timeout=300)
    return process.returncode, errors


@pytest.fixture(scope="module")
def cxx17_checks() -> dict[str, tuple[int, str]]:
    """Every kernel source checked at once (parsing torch's headers takes most of each)."""
    running = {e.name: cxx17_check(e.source, e.module_name) for e in EXTENSIONS}
    errors = {name: process.communicate(timeout=300)[1] for name, process in running.items()}
    return {name: (process.returncode, errors[name]) for name, process in running.items()}


@pytest.mark.parametrize("extension", EXTENSIONS, ids=lambda extension: extension.name)
def test_the_kernel_sources_compile_as_cxx17(extension: CppExtension, cxx17_checks) -> None:
    returncode, errors = cxx17_checks[extension.name]
    assert returncode == 0, errors[-3000:]


@pytest.mark.parametrize(
    "cxx20",
    [
        "#include <bit>\nstatic_assert(std::endian::native == std::endian::little);",
        "#include <bit>\nint bits(float x) { return std::bit_cast<int>(x); }",
        "struct Flags { bool on : 1 = false; };",  # a C++20 extension GCC only warns about
    ],
    ids=["std-endian", "std-bit-cast", "bit-field-initializer"],
)
def test_the_check_rejects_cxx20(cxx20: str, tmp_path: Path) -> None:
    """What would fail torch 2.11's build (the first two) fails this check too."""
    source = tmp_path / "cxx20.cpp"
    source.write_text(cxx20 + "\n")
    assert check_as_cxx17(source, "cxx20")[0] != 0


def test_a_header_change_rebuilds_the_kernels_that_include_it(tmp_path: Path) -> None:
    """The build folder's tag covers the headers a source includes with quotes, found
    next to the file that includes them, transitively."""
    (tmp_path / "inner").mkdir()
    (tmp_path / "kernel.cpp").write_text('#include "outer.h"\n#include <vector>\n')
    (tmp_path / "outer.h").write_text('#pragma once\n#include "inner/deep.h"\n')
    (tmp_path / "inner" / "deep.h").write_text("constexpr int kAnswer = 42;\n")
    extension = CppExtension("kernel", tmp_path / "kernel.cpp")
    assert [p.name for p in extension.sources()] == ["kernel.cpp", "outer.h", "deep.h"]
    before = extension.build_directory()
    (tmp_path / "inner" / "deep.h").write_text("constexpr int kAnswer = 43;\n")
    assert extension.build_directory() != before


def test_the_linears_share_the_amx_header() -> None:
    for extension in (group_linear.EXTENSION, bf16_linear.EXTENSION):
        assert "amx_tiles.h" in [p.name for p in extension.sources()][1:]


def test_the_group_linear_digest_covers_each_instruction_sets_tiles() -> None:
    """A change to any of the kernel's headers builds it again, whichever this CPU uses."""
    headers = {p.name for p in group_linear.EXTENSION.sources()[1:]}
    assert {"group_formats.h", "group_tiles_scalar.h", "group_tiles_avx2.h"} <= headers
    assert {"group_tiles_avx512.h", "group_tiles_amx.h"} <= headers


FALLBACK = """
import logging, torch
from engine.config import ConfigError
from engine.model.attention_backend import choose_backend
from engine.model.kernels.paged_attention import load_attention_kernel
logging.basicConfig(format="%(levelname)s %(message)s")
assert [load_attention_kernel() for _ in range(3)] == [None] * 3
cpu = torch.device("cpu")
print(choose_backend("auto", cpu, torch.float32, 64, 16).backend.name)
try:
    choose_backend("cpp", cpu, torch.float32, 64, 16)
except ConfigError as exc:
    print(exc)
"""


def test_without_a_compiler_attention_stays_on_torch_with_one_warning(tmp_path: Path) -> None:
    # A fresh cache holds no prebuilt library, so the loader needs the (missing) compiler.
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path), "CXX": "no-such-compiler-pagedserve"}
    result = subprocess.run(
        [sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    auto, cpp_error = result.stdout.splitlines()
    assert auto == "torch"
    assert cpp_error.startswith("attention_backend 'cpp'")
    assert "no C++ compiler 'no-such-compiler-pagedserve'" in cpp_error
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, result.stderr
    assert "no C++ compiler 'no-such-compiler-pagedserve'" in warnings[0]
