"""The recurrent layers' C++ kernels (`recurrent.cpp`): a causal depthwise convolution,
Gated DeltaNet's gated delta rule and Mamba-2's recurrence over a step's packed
sequences, each from its state slot, built once per machine and loaded on first use (see
`cpp_extension`). The extension defines them as the ops `pagedserve::causal_conv`,
`pagedserve::gated_delta_rule` and `pagedserve::ssd_scan`, which `engine.model.recurrent`'s
layers call, eager and compiled alike (`register_recurrent_ops` gives them their fakes)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.kernels.cpp_extension import CppExtension, KernelUnavailableError

EXTENSION = CppExtension("recurrent", Path(__file__).with_name("recurrent.cpp"))

_registered = False


def unavailable_reason(device: torch.device) -> str | None:
    """Why the ops cannot run on `device`, or None when they can (builds them, registers
    their fakes)."""
    if device.type != "cpu":
        return f"the recurrent layers' C++ kernels run on the CPU, not on {device}"
    global _registered
    if not _registered:
        try:
            EXTENSION.load()
        except KernelUnavailableError as exc:
            return str(exc)
        torch.library.register_fake("pagedserve::causal_conv")(_fake_rows)
        torch.library.register_fake("pagedserve::gated_delta_rule")(_fake_values)
        torch.library.register_fake("pagedserve::ssd_scan")(_fake_rows)
        _registered = True
    return None


def _fake_rows(x: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


def _fake_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object) -> torch.Tensor:
    return v.new_empty(v.shape, dtype=torch.float32)
