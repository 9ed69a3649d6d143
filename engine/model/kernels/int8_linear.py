"""The C++ weight-only int8 linear kernel (`int8_linear.cpp`), built once per machine and
loaded on first use (see `cpp_extension`)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.kernels.cpp_extension import CppExtension

EXTENSION = CppExtension("int8_linear", Path(__file__).with_name("int8_linear.cpp"))


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x @ (codes * scales[:, None]).T` on the CPU: x `[M, K]` fp32 or bf16, codes
    `[N, K]` int8, scales `[N]` fp32 or bf16; returns `[M, N]` in x's dtype, computed in
    fp32 and rounded once. An output element's bits depend only on its row of x and the
    weights, never on M or the other rows (see the source's "Invariance"). Raises
    `KernelUnavailableError` if the kernel cannot be built here."""
    return EXTENSION.load().int8_linear(x, codes, scales)
