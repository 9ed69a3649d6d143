"""Sizing the KV cache: how many blocks fit in the memory the model leaves over.

Pure arithmetic on numbers the engine measures, plus `profile_num_blocks`, which reads
them (psutil on the CPU; callables the engine passes in on CUDA, so torch is never
imported here). The engine runs a profiling forward at the largest batch first, so the
numbers include the model's weights and its peak activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import psutil

from cache.block import cdiv

logger = logging.getLogger(__name__)

# The CPU's budget when `kv_cache_memory` is unset, as the server's preset sets it: system
# memory is everyone's, and zero-filling 90% of what is available froze a shared machine
# (the kernel reclaimed page cache for minutes) for KV that a few prompts never use.
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


def num_kv_blocks(
    *,
    block_bytes: int,
    device_type: str,
    memory_utilization: float,
    kv_cache_memory: int | None,
    max_model_len: int,
    block_size: int,
    watermark: float = 0.0,
    max_num_seqs: int | None = None,
    cuda_mem_get_info: tuple[int, int] | None = None,
    cuda_allocated: int | None = None,
    cuda_peak_allocated: int | None = None,
    cpu_available: int | None = None,
    cpu_reserved: int = 0,
) -> int:
    """The number of KV blocks to allocate, from measured numbers.

    The profiled budget is `kv_cache_bytes_cuda` (`device_type == "cuda"`, needing
    `cuda_mem_get_info` as `(free, total)`, `cuda_allocated` and `cuda_peak_allocated`) or
    `kv_cache_bytes_cpu` (`"cpu"`, needing `cpu_available`; `cpu_reserved`, the bytes of
    memory-mapped weights). An explicit `kv_cache_memory`
    overrides it downwards only: the budget is `min(kv_cache_memory, profiled)`, since more
    than the profiled figure would run the device out of memory. On the CPU an unset
    `kv_cache_memory` means `CPU_DEFAULT_KV_CACHE_MEMORY`. With `max_num_seqs`, never more
    blocks than that many `max_model_len` sequences can use, plus the watermark reserve.
    The result is logged with the figure that decided it.

    Pass the block manager's `watermark` so that a `max_model_len` prompt is admissible: it
    must fit in the blocks outside the reserve. Raises InsufficientKVCacheError otherwise.
    """
    if device_type == "cuda":
        if cuda_mem_get_info is None or cuda_allocated is None or cuda_peak_allocated is None:
            raise ValueError(
                "device 'cuda' needs cuda_mem_get_info, cuda_allocated and cuda_peak_allocated"
            )
        free, total = cuda_mem_get_info
        profiled = kv_cache_bytes_cuda(
            total=total,
            free=free,
            allocated=cuda_allocated,
            peak_allocated=cuda_peak_allocated,
            memory_utilization=memory_utilization,
        )
    elif device_type == "cpu":
        if cpu_available is None:
            raise ValueError("device 'cpu' needs cpu_available")
        profiled = kv_cache_bytes_cpu(
            available=cpu_available, memory_utilization=memory_utilization, reserved=cpu_reserved
        )
    else:
        raise ValueError(f"unsupported device type {device_type!r}: expected 'cuda' or 'cpu'")

    limit = kv_cache_memory
    why = "kv_cache_memory"
    if limit is None and device_type == "cpu":
        limit, why = CPU_DEFAULT_KV_CACHE_MEMORY, "the CPU default (set kv_cache_memory for more)"
    budget = profiled if limit is None else min(limit, profiled)
    capped = budget < profiled
    if not capped:
        why = f"memory_utilization {memory_utilization} of the free {device_type} memory"
    num_blocks = budget // block_bytes
    num_required = cdiv(max_model_len, block_size)
    if num_blocks - int(watermark * num_blocks) >= num_required:
        usable = None if max_num_seqs is None else max_num_seqs * num_required
        if usable is not None and num_blocks - int(watermark * num_blocks) > usable:
            num_blocks = int(usable / (1 - watermark)) + 1
            why = f"all that max_num_seqs={max_num_seqs} sequences of {max_model_len} tokens use"
        logger.info(
            "KV cache: %d blocks of %d tokens, %.2f GiB: %s",
            num_blocks, block_size, num_blocks * block_bytes / 2**30, why,
        )  # fmt: skip
        return num_blocks
    if capped:
        remedy = f"raise kv_cache_memory (now {limit} bytes) or lower max_model_len"
    else:
        remedy = (
            f"raise memory_utilization (now {memory_utilization}), free {device_type} memory "
            "or lower max_model_len"
        )
    reserve = f" outside the {watermark:.0%} watermark reserve" if watermark else ""
    raise InsufficientKVCacheError(
        f"KV cache too small: {budget} bytes hold {num_blocks} blocks of {block_bytes} bytes, "
        f"but one max_model_len={max_model_len} sequence needs {num_required} blocks of "
        f"{block_size} tokens{reserve}; {remedy}"
    )


def profile_num_blocks(
    *,
    block_bytes: int,
    device_type: str,
    memory_utilization: float,
    kv_cache_memory: int | None,
    max_model_len: int,
    block_size: int,
    watermark: float = 0.0,
    max_num_seqs: int | None = None,
    cuda_mem_get_info: Callable[[], tuple[int, int]] | None = None,
    cuda_memory_stats: Callable[[], Mapping[str, int]] | None = None,
    cpu_reserved: int = 0,
) -> int:
    """`num_kv_blocks` with the memory figures read now.

    Call it right after the profiling forward. On CUDA pass `torch.cuda.mem_get_info` and
    `torch.cuda.memory_stats` (reset the peak before the forward with
    `torch.cuda.reset_peak_memory_stats()` and call `torch.cuda.empty_cache()` after it);
    on the CPU psutil's available memory is used, less `cpu_reserved` (the model's
    memory-mapped weights).
    """
    mem_get_info = None
    allocated = peak_allocated = cpu_available = None
    if device_type == "cuda":
        if cuda_mem_get_info is None or cuda_memory_stats is None:
            raise ValueError("device 'cuda' needs cuda_mem_get_info and cuda_memory_stats")
        mem_get_info = cuda_mem_get_info()
        stats = cuda_memory_stats()
        allocated = stats["allocated_bytes.all.current"]
        peak_allocated = stats["allocated_bytes.all.peak"]
    elif device_type == "cpu":
        cpu_available = psutil.virtual_memory().available
    return num_kv_blocks(
        block_bytes=block_bytes,
        device_type=device_type,
        memory_utilization=memory_utilization,
        kv_cache_memory=kv_cache_memory,
        max_model_len=max_model_len,
        block_size=block_size,
        watermark=watermark,
        max_num_seqs=max_num_seqs,
        cuda_mem_get_info=mem_get_info,
        cuda_allocated=allocated,
        cuda_peak_allocated=peak_allocated,
        cpu_available=cpu_available,
        cpu_reserved=cpu_reserved,
    )
