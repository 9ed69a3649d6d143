"""The attention-backend interface and the registry of backends, by `attention_backend` name.

A backend stores a step's new K/V into the paged KV tensor and attends each query row over
its sequence's blocks; `engine.model.attention` does what every backend shares (the
layer's features, the softmax scale, one head size for Q, K and V) and calls the backend
the engine bound at start-up, once, for the model's device, dtype and KV head size.

The backends live in components of their own and are imported only here, lazily, by name:
- `cpp` (`kernels.paged_attention`): the C++ kernel, on the CPU; its store and attention
  are registered ops, so it also runs inside the compiled forward.
- `triton` (`kernels.triton_attention`): the Triton kernels, on CUDA (on the CPU only
  through Triton's interpreter); they read only device tensors, so the decode graphs can
  capture them. `auto`'s first choice on CUDA (the fastest there: docs/gpu.md).
- `torch` (`torch_attention`): plain torch, on any device: blockwise and row-invariant on
  the CPU, gathered (fast, batch-dependent bits) elsewhere.

A component whose module cannot be imported (its files removed, Triton not installed) is a
backend that is unavailable, with that import error as its reason; the rest of the engine
never imports a component itself. `auto` takes the first available backend of `AUTO_ORDER` for
the device and logs why it passed over the ones before it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.config import ConfigError
from engine.model.attention_metadata import AttentionFeatures, PagedAttentionMetadata

logger = logging.getLogger(__name__)

# Setting name -> (module, class) of the backend; imported on first use.
BACKENDS: dict[str, tuple[str, str]] = {
    "cpp": ("engine.model.kernels.paged_attention", "CppAttention"),
    "triton": ("engine.model.kernels.triton_attention", "TritonAttention"),
    "torch": ("engine.model.torch_attention", "TorchAttention"),
}
# What `auto` tries, in order, by device type; torch runs everywhere and ends each list.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cpu": ("cpp", "torch"), "cuda": ("triton", "torch")}
OTHER_DEVICES_AUTO_ORDER = ("torch",)


class AttentionBackend(Protocol):
    """One way to store K/V and attend over the paged KV tensor.

    Contract: `kv_cache` is one of the engine's `[num_layers, 2, num_blocks, block_size,
    Hkv, D]` tensors (one per K/V shape); `store_kv` writes key and value `[T, Hkv, D]` of
    the step's packed tokens into `kv_cache[layer]` at `slots` `[T]` (int64; a negative
    slot, a padding row of a compiled or captured step, is written only by backends that
    `compiles` or `captures`, and must be skipped). `attend` takes the packed query rows
    `q [T, H, D]` (H a multiple of Hkv) and returns `[T, H, D]` in q's dtype: for the row
    at position p, softmax(scale * q . K^T) V over positions 0..p of its sequence (see
    `PagedAttentionMetadata`), with the layer's `AttentionFeatures` applied. Scores and
    the softmax are computed in fp32.

    `compiles`: the store and the attention are registered ops that the compiled forward
    (Inductor, on the CPU) keeps as calls, reading only the metadata's tensors.
    `captures`: both read only the metadata's tensors and `max_query_len`, never its host
    arrays, so the decode graphs (CUDA graphs) can capture them.

    Constructed as `cls(device)` once `cls.unavailable_reason(...)` says None for the
    engine's device, dtype, KV head size (K's and V's padded to one) and block size.
    """

    name: str
    compiles: bool
    captures: bool

    def __init__(self, device: torch.device) -> None: ...

    @staticmethod
    def unavailable_reason(
        device: torch.device, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        """Why this backend cannot run for these, or None if it can (may build a kernel)."""
        ...

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: PagedAttentionMetadata,
        scale: float,
        features: AttentionFeatures,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The backend an engine runs, and for `auto` each backend tried before it, with the
    reason it could not run (for messages that say why, e.g. why steps stay eager)."""

    backend: AttentionBackend
    passed_over: dict[str, str] = field(default_factory=dict)


def unavailable_reason(
    name: str, device: torch.device, dtype: torch.dtype, head_size: int, block_size: int
) -> str | None:
    """Why backend `name` cannot run for these, or None if it can."""
    found = _runnable(name, device, dtype, (head_size,), block_size)
    return found if isinstance(found, str) else None


def choose_backend(
    setting: str,
    device: torch.device,
    dtype: torch.dtype,
    head_sizes: int | tuple[int, ...],
    block_size: int,
) -> BackendChoice:
    """The backend for the `attention_backend` setting, constructed for `device`, that runs
    every one of the model's KV head sizes. A named backend that cannot run raises a
    `ConfigError` naming the setting and the reason; `auto` takes the first that can in
    `AUTO_ORDER` and logs, at info, why not the ones before it."""
    sizes = (head_sizes,) if isinstance(head_sizes, int) else head_sizes
    if setting != "auto":
        backend = _ready(setting, device, dtype, sizes, block_size)
        if isinstance(backend, str):
            raise ConfigError(f"attention_backend '{setting}' cannot run here: {backend}")
        return BackendChoice(backend)
    passed_over: dict[str, str] = {}
    for name in AUTO_ORDER.get(device.type, OTHER_DEVICES_AUTO_ORDER):
        backend = _ready(name, device, dtype, sizes, block_size)
        if not isinstance(backend, str):
            if passed_over:
                reasons = "; ".join(f"not '{n}': {why}" for n, why in passed_over.items())
                logger.info("attention backend '%s' (auto; %s)", name, reasons)
            return BackendChoice(backend, passed_over)
        passed_over[name] = backend
    raise ConfigError(  # only where the torch backend's own module is broken
        "attention_backend 'auto': no backend runs here: "
        + "; ".join(f"'{n}': {why}" for n, why in passed_over.items())
    )


def _ready(
    name: str, device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], block_size: int
) -> AttentionBackend | str:
    """Backend `name` constructed for `device`, or why it cannot run for these."""
    found = _runnable(name, device, dtype, sizes, block_size)
    return found if isinstance(found, str) else found(device)


def _runnable(
    name: str, device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], block_size: int
) -> type[AttentionBackend] | str:
    """Backend `name`'s class where it can run for these (every head size), else why it
    cannot."""
    backend = _backend_class(name)
    if isinstance(backend, str):
        return backend
    for size in sizes:
        reason = backend.unavailable_reason(device, dtype, size, block_size)
        if reason is not None:
            return reason
    return backend


def _backend_class(name: str) -> type[AttentionBackend] | str:
    """The backend class registered under `name`, or why its module cannot be imported."""
    module_name, class_name = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return f"its module {module_name} cannot be imported ({exc})"
    backend: type[AttentionBackend] = getattr(module, class_name)
    return backend
