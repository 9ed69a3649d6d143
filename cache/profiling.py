"""Sizing the KV cache: how many blocks fit in the memory the model leaves over.

Pure arithmetic on numbers the engine measures, plus `profile_num_blocks`, which reads
them (psutil on the CPU; callables the engine passes in on CUDA, so torch is never
imported here). The engine runs a profiling forward at the largest batch first, so the
numbers include the model's weights and its peak activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil

from cache.block import cdiv

logger = logging.getLogger(__name__)

# The CPU's budget when `kv_cache_memory` is unset, as the server's preset sets it: system
# memory is shared with everything else on the machine, and zero-filling most of what is
# available makes the kernel reclaim page cache for KV that a few prompts never use.
CPU_DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


class InsufficientKVCacheError(RuntimeError):
    """Not even one `max_model_len` sequence fits; the message names the setting to change."""


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_size: int
) -> int:
    """Bytes of one block across all layers: a K and a V vector per token, layer and head."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size


def kv_cache_bytes_cuda(
    *, total: int, free: int, allocated: int, peak_allocated: int, memory_utilization: float
) -> int:
    """Bytes the KV cache may take on a GPU: `total * memory_utilization` minus peak use.

    `free, total` come from `torch.cuda.mem_get_info()` (whole device, every process) and
    `allocated` from torch's allocator, both read after the profiling forward and
    `torch.cuda.empty_cache()`; `peak_allocated` is the allocator's peak during that forward.
    Device memory in use at the peak was `(total - free) - allocated + peak_allocated`:
    other processes, the CUDA context and weights, plus the forward's activations.
    Without `empty_cache()` the allocator's cached activations count twice: safe, but the
    cache comes out smaller.
    """
    used_at_peak = total - free - allocated + peak_allocated
    return max(0, int(total * memory_utilization) - used_at_peak)


def kv_cache_bytes_cpu(*, available: int, memory_utilization: float, reserved: int = 0) -> int:
    """Bytes the KV cache may take in system memory: `(available - reserved) *
    memory_utilization`.

    `available` is psutil's figure read with the model already loaded, so it excludes the
    weights the model allocated; `reserved` is the weights it maps from a file (a GGUF's
    converted tensors), which psutil counts as available (page cache, or not yet read) but
    which every step reads, so the model's own bytes are counted first. The
    `1 - memory_utilization` share left over is the room for activations.
    """
    return max(0, int(max(0, available - reserved) * memory_utilization))


@dataclass(frozen=True, slots=True)
class KVSizing:
    """What sizes the KV cache besides the memory figures read at start-up: the bytes of a
    block (`bytes_per_block`), the device type (`"cuda"` or `"cpu"`), the settings that
    bound the budget, and `cpu_reserved`, the bytes of the model's memory-mapped weights
    (a GGUF's converted tensors) on the CPU.

    Pass the block manager's `watermark` so that a `max_model_len` prompt is admissible: it
    must fit in the blocks outside the reserve. With `max_num_seqs`, never more blocks than
    that many `max_model_len` sequences can use, plus the watermark reserve.

    A hybrid model's recurrent layers keep `state_bytes` per sequence (0: no recurrent
    layers) in state slots drawn from the same budget: `state_share` of it, at most two
    slots per `max_num_seqs` (a running sequence's state and a prefix checkpoint), at
    least one; the blocks get the rest.
    """

    block_bytes: int
    device_type: str
    memory_utilization: float
    kv_cache_memory: int | None
    max_model_len: int
    block_size: int
    watermark: float = 0.0
    max_num_seqs: int | None = None
    cpu_reserved: int = 0
    state_bytes: int = 0
    state_share: float = 0.5


@dataclass(frozen=True, slots=True)
class CacheSize:
    """How much cache a budget holds: KV blocks, and recurrent state slots (0 without
    recurrent layers)."""

    num_blocks: int
    num_state_slots: int = 0


def num_kv_blocks(
    sizing: KVSizing,
    *,
    cuda_mem_get_info: tuple[int, int] | None = None,
    cuda_allocated: int | None = None,
    cuda_peak_allocated: int | None = None,
    cpu_available: int | None = None,
) -> CacheSize:
    """The number of KV blocks (and recurrent state slots) to allocate, from measured
    numbers.

    The profiled budget is `kv_cache_bytes_cuda` (`device_type == "cuda"`, needing
    `cuda_mem_get_info` as `(free, total)`, `cuda_allocated` and `cuda_peak_allocated`) or
    `kv_cache_bytes_cpu` (`"cpu"`, needing `cpu_available`, less `sizing.cpu_reserved`).
    An explicit `kv_cache_memory` overrides it downwards only: the budget is
    `min(kv_cache_memory, profiled)`, since more than the profiled figure would run the
    device out of memory. On the CPU an unset `kv_cache_memory` means
    `CPU_DEFAULT_KV_CACHE_MEMORY`. The result is logged with the figure that decided it.
    Raises InsufficientKVCacheError when one `max_model_len` sequence does not fit
    outside the watermark reserve (or its recurrent state does not fit at all).
    """
    profiled = _profiled_bytes(
        sizing, cuda_mem_get_info, cuda_allocated, cuda_peak_allocated, cpu_available
    )
    budget, limit, why = _budget(sizing, profiled)
    num_slots = _state_slots(sizing, budget)
    num_blocks = (budget - num_slots * sizing.state_bytes) // sizing.block_bytes
    num_required = cdiv(sizing.max_model_len, sizing.block_size)
    watermark, max_num_seqs = sizing.watermark, sizing.max_num_seqs
    if num_blocks - int(watermark * num_blocks) < num_required:
        cap = limit if budget < profiled else None
        raise _too_small(sizing, budget, num_blocks, num_required, cap)
    usable = None if max_num_seqs is None else max_num_seqs * num_required
    if usable is not None and num_blocks - int(watermark * num_blocks) > usable:
        num_blocks = int(usable / (1 - watermark)) + 1
        why = f"all that max_num_seqs={max_num_seqs} sequences of {sizing.max_model_len} tokens use"
    logger.info(
        "KV cache: %d blocks of %d tokens, %.2f GiB: %s",
        num_blocks, sizing.block_size, num_blocks * sizing.block_bytes / 2**30, why,
    )  # fmt: skip
    if num_slots:
        logger.info(
            "recurrent state: %d slots of %.1f MiB (running sequences and prefix "
            "checkpoints), %.2f GiB: state_share %s of the budget",
            num_slots, sizing.state_bytes / 2**20, num_slots * sizing.state_bytes / 2**30,
            sizing.state_share,
        )  # fmt: skip
    return CacheSize(num_blocks, num_slots)


def _state_slots(sizing: KVSizing, budget: int) -> int:
    """The state slots `sizing.state_share` of `budget` holds (see `KVSizing`)."""
    if not sizing.state_bytes:
        return 0
    num_slots = int(budget * sizing.state_share) // sizing.state_bytes
    if sizing.max_num_seqs is not None:
        num_slots = min(num_slots, 2 * sizing.max_num_seqs)
    if num_slots < 1:
        raise InsufficientKVCacheError(
            f"KV cache too small: state_share {sizing.state_share} of {budget} bytes does "
            f"not hold one sequence's recurrent state ({sizing.state_bytes} bytes); raise "
            "kv_cache_memory or state_share"
        )
    return num_slots


def _profiled_bytes(
    sizing: KVSizing,
    cuda_mem_get_info: tuple[int, int] | None,
    cuda_allocated: int | None,
    cuda_peak_allocated: int | None,
    cpu_available: int | None,
) -> int:
    """The bytes the measured figures leave the KV cache on the sizing's device."""
    if sizing.device_type == "cuda":
        if cuda_mem_get_info is None or cuda_allocated is None or cuda_peak_allocated is None:
            raise ValueError(
                "device 'cuda' needs cuda_mem_get_info, cuda_allocated and cuda_peak_allocated"
            )
        free, total = cuda_mem_get_info
        return kv_cache_bytes_cuda(
            total=total,
            free=free,
            allocated=cuda_allocated,
            peak_allocated=cuda_peak_allocated,
            memory_utilization=sizing.memory_utilization,
        )
    if sizing.device_type == "cpu":
        if cpu_available is None:
            raise ValueError("device 'cpu' needs cpu_available")
        return kv_cache_bytes_cpu(
            available=cpu_available,
            memory_utilization=sizing.memory_utilization,
            reserved=sizing.cpu_reserved,
        )
    raise ValueError(f"unsupported device type {sizing.device_type!r}: expected 'cuda' or 'cpu'")


def _budget(sizing: KVSizing, profiled: int) -> tuple[int, int | None, str]:
    """The KV cache's bytes (`kv_cache_memory`, or the CPU default, capping `profiled`),
    the limit that capped it (None: none) and the figure that decided it, for the log."""
    limit, why = sizing.kv_cache_memory, "kv_cache_memory"
    if limit is None and sizing.device_type == "cpu":
        limit, why = CPU_DEFAULT_KV_CACHE_MEMORY, "the CPU default (set kv_cache_memory for more)"
    budget = profiled if limit is None else min(limit, profiled)
    if budget >= profiled:
        why = (
            f"memory_utilization {sizing.memory_utilization} of the free "
            f"{sizing.device_type} memory"
        )
    return budget, limit, why


def _too_small(
    sizing: KVSizing, budget: int, num_blocks: int, num_required: int, cap: int | None
) -> InsufficientKVCacheError:
    """The error for a budget that holds no `max_model_len` sequence outside the reserve,
    naming the setting to change: `kv_cache_memory` where it capped the budget (`cap`,
    its value or the CPU default; None where the profiled figure decided)."""
    if cap is not None:
        remedy = f"raise kv_cache_memory (now {cap} bytes) or lower max_model_len"
    else:
        remedy = (
            f"raise memory_utilization (now {sizing.memory_utilization}), free "
            f"{sizing.device_type} memory or lower max_model_len"
        )
    reserve = f" outside the {sizing.watermark:.0%} watermark reserve" if sizing.watermark else ""
    return InsufficientKVCacheError(
        f"KV cache too small: {budget} bytes hold {num_blocks} blocks of {sizing.block_bytes} "
        f"bytes, but one max_model_len={sizing.max_model_len} sequence needs {num_required} "
        f"blocks of {sizing.block_size} tokens{reserve}; {remedy}"
    )


def profile_num_blocks(
    sizing: KVSizing,
    *,
    cuda_mem_get_info: Callable[[], tuple[int, int]] | None = None,
    cuda_memory_stats: Callable[[], Mapping[str, int]] | None = None,
) -> CacheSize:
    """`num_kv_blocks` with the memory figures read now.

    Call it right after the profiling forward. On CUDA pass `torch.cuda.mem_get_info` and
    `torch.cuda.memory_stats` (reset the peak before the forward with
    `torch.cuda.reset_peak_memory_stats()` and call `torch.cuda.empty_cache()` after it);
    on the CPU psutil's available memory is used, less `sizing.cpu_reserved` (the model's
    memory-mapped weights).
    """
    if sizing.device_type == "cuda":
        if cuda_mem_get_info is None or cuda_memory_stats is None:
            raise ValueError("device 'cuda' needs cuda_mem_get_info and cuda_memory_stats")
        mem_get_info = cuda_mem_get_info()
        stats = cuda_memory_stats()
        return num_kv_blocks(
            sizing,
            cuda_mem_get_info=mem_get_info,
            cuda_allocated=stats["allocated_bytes.all.current"],
            cuda_peak_allocated=stats["allocated_bytes.all.peak"],
        )
    if sizing.device_type == "cpu":
        return num_kv_blocks(sizing, cpu_available=psutil.virtual_memory().available)
    return num_kv_blocks(sizing)
