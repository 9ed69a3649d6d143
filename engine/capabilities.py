"""The one entry point from the engine's core to its optional components, each imported only when a
setting asks for it:

- `engine.compiled`: the compiled forward (CPU) and the decode graphs (CUDA), chosen by
  `enforce_eager` (`step_executor`);
- `engine.linears`: packed, bf16 and quantized linears, chosen by `quantization`: a
  GGUF's own types (`gguf_install`), int8/int4 groups (`quantize`), and packing on the
  CPU (`pack`);
- `engine.grammar`: structured outputs and tool-call grammars through llguidance, asked
  for by a request's `structured_outputs` (`grammar_compiler`);
- `engine.kv_tiers`: the disk tier under the prefix cache, chosen by `kv_disk_size`
  (`kv_tier`), or host RAM beside a GPU, by `kv_offloading_size` (`host_kv_tier`);
- `engine.kv_events`: KV-cache events over ZMQ, chosen by `kv_events_config`
  (`kv_event_publisher`);
- `engine.lora`: LoRA adapters on the model's projections, chosen by `enable_lora` or
  `lora_modules` (`lora_adapters`);
- the C++ and Triton attention kernels, chosen by `attention_backend`, have their own
  entry point: the backend registry, `engine.model.attention_backend`;
- the recurrent layers' C++ kernels (`engine.model.kernels.recurrent`), for a hybrid
  model on the CPU (`recurrent_kernels`).

The functions return objects of interfaces the core defines (`StepExecutor`,
`ConstraintCompiler`) or do the component's work once at load (the linears). A component that
cannot be imported (its folder removed, a dependency not installed) leaves the core
importable and serving: what needs it fails with one line that names the setting, or,
where nothing asked for it explicitly, goes without it and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from cache import KVEvent
from engine.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from engine.adapters import Adapters
    from engine.kv_events_config import KVEventsConfig
    from engine.kv_tier import KVTier, Publish
    from engine.model.loader import Install
    from engine.model.runner import EagerSteps, StepExecutor
    from engine.sampling.logits_constraint import ConstraintCompiler

logger = logging.getLogger(__name__)

StepPath = Literal["eager", "compiled", "graphs"]


def missing(component: str, exc: ImportError) -> str:
    """The reason a component cannot serve: its import failed."""
    return f"{component} cannot be imported here ({exc})"


def step_executor(path: StepPath, max_num_seqs: int) -> Callable[[EagerSteps], StepExecutor]:
    """What makes the runner's executor from its eager path: the compiled forward, the
    decode graphs, or the eager path itself. A missing component raises `ConfigError` naming
    `enforce_eager`, the setting that chose the path."""
    try:
        if path == "compiled":
            from engine.compiled.compiled_forward import CompiledForward

            return CompiledForward
        if path == "graphs":
            from engine.compiled.decode_graphs import DecodeGraphs

            return partial(DecodeGraphs, max_num_seqs=max_num_seqs)
    except ImportError as exc:
        raise ConfigError(f"enforce_eager false: {missing('engine.compiled', exc)}") from None
    return lambda eager: eager


def recurrent_kernels(device: torch.device) -> str | None:
    """Why a hybrid model's recurrent layers cannot run their C++ kernels on `device` (they
    then run their torch reference), or None when they can (built and registered now)."""
    try:
        from engine.model.kernels import recurrent
    except ImportError as exc:
        return missing("engine.model.kernels.recurrent", exc)
    return recurrent.unavailable_reason(device)


def compiled_unavailable() -> str | None:
    """Why the compiled forward's component cannot serve here, or None when it can."""
    try:
        import engine.compiled.compiled_forward  # noqa: F401
    except ImportError as exc:
        return missing("engine.compiled", exc)
    return None


def decode_graphs_unavailable() -> str | None:
    """Why the decode graphs' component cannot serve here, or None when it can."""
    try:
        import engine.compiled.decode_graphs  # noqa: F401
    except ImportError as exc:
        return missing("engine.compiled", exc)
    return None


def pooling_dtype(setting: str) -> torch.dtype:
    """A pooling model's compute dtype on the CPU: the setting, or with 'auto' bf16 where the
    bf16 linears run on AMX tiles, else fp32. On AMX bf16 embeds 2.5x fp32's texts a second
    at 32 texts a request, at cosine 0.9999 to fp32; with AVX512-BF16's dot products alone
    it is slower than oneDNN's fp32 at many rows (docs/embeddings.md)."""
    from engine.model.device import resolve_dtype
    from engine.model.kernels import bf16_linear

    if setting != "auto":
        return resolve_dtype(setting, torch.device("cpu"))
    if bf16_linear.runs_on_amx():
        logger.info("dtype auto: bf16, the CPU's AMX tiles computing it (dtype: float32 is exact)")
        return torch.bfloat16
    return torch.float32


def quantization_unavailable(device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """Why the linears of quantization `mode` cannot run here, or None when they can."""
    try:
        from engine.linears import quantized_linear
    except ImportError as exc:
        return missing("engine.linears", exc)
    return quantized_linear.unavailable_reason(device, dtype, mode)


def quantization_mode(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, every_row_count: bool = False
) -> str:
    """The quantization mode a model of `config` runs in `dtype` on `device`: the setting,
    or with 'auto' the one the checkpoint ships in ("gguf": a GGUF's own types) where the
    kernel can run it here (else "none", with a warning), and, for a model whose kernel
    must compute `every_row_count`, runs it fast at many rows (AVX2 or AVX512-VNNI; else
    "none"). Raises `ConfigError` naming the setting where an explicit mode cannot run
    here, or 'gguf' is asked of a model that is not a quantized GGUF."""
    from engine.model.loader import checkpoint_quantization

    asked = config.quantization
    if asked not in ("auto", "none"):
        reason = quantization_unavailable(device, dtype, asked)
        if reason is not None:
            raise ConfigError(
                f"quantization '{asked}' cannot run in this engine ({dtype} on {device}): {reason}"
            )
    checkpoint = checkpoint_quantization(config.model)
    if asked == "gguf" and checkpoint != "gguf":
        raise ConfigError(
            f"quantization 'gguf' serves a GGUF file's own quantized types, and model "
            f"'{config.model}' is not such a file"
        )
    if asked != "auto":
        return asked
    if checkpoint != "none":
        reason = quantization_unavailable(device, dtype, checkpoint)
        if reason is not None:
            logger.warning(
                "the checkpoint's tensors are quantized, but the kernel cannot run here "
                "(%s): serving them dequantized to %s",
                reason, dtype,
            )  # fmt: skip
            return "none"
        if every_row_count and _scalar_kernel(dtype):
            logger.info(
                "the checkpoint's tensors are quantized, but the kernel runs many rows fast "
                "only with AVX2 or AVX512-VNNI: serving them dequantized to %s "
                "(quantization: gguf keeps them)",
                dtype,
            )
            return "none"
        logger.info("quantization gguf: the checkpoint's own types (quantization: auto)")
    return checkpoint


def _scalar_kernel(dtype: torch.dtype) -> bool:
    """Whether the quantized kernel here is its scalar twin, which a dense linear outruns
    at many rows (`quantization_unavailable` allowed the kernel)."""
    from engine.linears import quantized_linear

    return quantized_linear.max_kernel_rows(dtype) is not None


def quantize(
    model: PreTrainedModel,
    mode: str,
    dtype: torch.dtype,
    folder: Path | None,
    every_row_count: bool = False,
) -> None:
    """Quantize the model's linears to `mode`, which `quantization_unavailable` allowed.
    `every_row_count`: the kernel computes calls of any size, never a dense copy (slower
    where the kernel is its scalar twin), so a row's bits never depend on the call's size."""
    from engine.linears import quantized_linear

    rows = None if every_row_count else quantized_linear.max_kernel_rows(dtype)
    quantized_linear.quantize_linear_layers(model, mode, rows, folder)


def gguf_install(dtype: torch.dtype, every_row_count: bool = False) -> Install:
    """What puts a GGUF's weights into a model in their own GGML types (the quantized
    kernel's layers), for `load_model`; `quantization_unavailable` allowed "gguf".
    `every_row_count` as for `quantize`."""
    from engine.linears import gguf_store, quantized_linear

    rows = None if every_row_count else quantized_linear.max_kernel_rows(dtype)
    return lambda model, path: gguf_store.install(model, path, dtype, rows)


def pack(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> Callable[[int], int]:
    """Pack the model's remaining `nn.Linear`s where packing runs (the CPU); without the
    linears component they stay as they are (the same results, slower), with a warning.
    Returns the row count the linears compute a call of n rows with (n where nothing was
    packed): rows padded to it once, up front, are not padded again by every linear."""
    try:
        from engine.linears.packed_linear import (
            PackedLinear,
            can_pack,
            pack_linear_layers,
            padded_rows,
        )
    except ImportError as exc:
        if device.type == "cpu":
            logger.warning("linears not packed: %s", missing("engine.linears", exc))
        return _as_given
    if not can_pack(device, dtype):
        return _as_given
    pack_linear_layers(model)
    packed = any(isinstance(module, PackedLinear) for module in model.modules())
    return padded_rows if packed else _as_given


def _as_given(rows: int) -> int:
    return rows


def lora_adapters(model: PreTrainedModel, device: torch.device, config: EngineConfig) -> Adapters:
    """Wrap the model's projections for `max_loras` adapters of rank up to `max_lora_rank`
    (after its linears were quantized or packed) and return its adapters, none yet."""
    try:
        from engine.lora.layers import LoRASlots
        from engine.lora.registry import LoRARegistry
    except ImportError as exc:
        raise ConfigError(f"enable_lora: {missing('engine.lora', exc)}") from None
    slots = LoRASlots(config.max_loras, config.max_lora_rank, device)
    return LoRARegistry(slots, slots.wrap(model))


def grammar_compiler(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int]
) -> ConstraintCompiler | None:
    """The grammar component's compiler for this model, or None (with a warning) where the component
    cannot be imported: requests with `structured_outputs` or tools are then refused."""
    try:
        from engine.grammar.grammar import GrammarCompiler
    except ImportError as exc:
        reason = missing("engine.grammar", exc)
        logger.warning("structured outputs and tool grammars are off: %s", reason)
        return None
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)


def kv_tier(
    kv_caches: tuple[torch.Tensor, ...], capacity: int, root: Path, source: Path,
    settings: Mapping[str, str], block_size: int, publish: Publish | None,
) -> KVTier:  # fmt: skip
    """The disk tier of `capacity` bytes under `root`, in the folder of this model's files
    and `settings` (what changes a block's bits). Fails with one line naming
    `kv_disk_size` where the component cannot be imported or the folder cannot be used."""
    try:
        from engine.kv_tiers.disk_tier import DiskTier, tier_key
    except ImportError as exc:
        raise ConfigError(f"kv_disk_size: {missing('engine.kv_tiers', exc)}") from None
    try:
        key = tier_key(settings, source)
        return DiskTier(kv_caches, capacity, root, key, block_size, publish)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"kv_disk_size: the disk tier at {root} cannot serve: {exc}") from None


def host_kv_tier(
    kv_caches: tuple[torch.Tensor, ...], capacity: int, block_size: int, publish: Publish | None
) -> KVTier:
    """A pool of `capacity` bytes of pinned host memory beside a GPU's KV tensor; fails
    with one line naming `kv_offloading_size`."""
    try:
        from engine.kv_tiers.host_tier import HostTier
    except ImportError as exc:
        raise ConfigError(f"kv_offloading_size: {missing('engine.kv_tiers', exc)}") from None
    try:
        return HostTier(kv_caches, capacity, block_size, publish)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"kv_offloading_size: {exc}") from None


class EventPublisher(Protocol):
    def publish(self, events: Sequence[KVEvent]) -> None: ...

    def close(self) -> None: ...


def kv_event_publisher(config: KVEventsConfig | None) -> EventPublisher | None:
    """The ZMQ publisher `kv_events_config` asks for, bound to its endpoints; None when
    events are off. A missing pyzmq or msgpack, or an endpoint that cannot be bound,
    fails with one line naming `kv_events_config`."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    try:
        from engine.kv_events.zmq_publisher import ZmqEventPublisher
    except ImportError as exc:
        raise ConfigError(
            f"kv_events_config: {missing('engine.kv_events', exc)}; "
            "pip install 'pagedserve[kv-events]'"
        ) from None
    try:
        return ZmqEventPublisher(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
