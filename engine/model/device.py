"""Choosing the device and the compute dtype: the same code runs on CUDA and the CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(setting: str) -> torch.device:
    """`auto` is CUDA when present, else the CPU; asking for CUDA without one is an error."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 where the device computes it fast, else fp16 on CUDA, fp32 on the CPU."""
    if setting != "auto":
        return _DTYPES[setting]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
