"""KV-cache sizing arithmetic: block bytes, the CUDA and CPU budgets, the too-small error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import cache.profiling
from cache import (
    InsufficientKVCacheError,
    KVSizing,
    bytes_per_block,
    kv_cache_bytes_cpu,
    kv_cache_bytes_cuda,
    num_kv_blocks,
    profile_num_blocks,
)
from cache.profiling import CPU_DEFAULT_KV_CACHE_MEMORY

GIB = 1 << 30
MIB = 1 << 20
BLOCK = bytes_per_block(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype_size=2)


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    assert BLOCK == 2 * 30 * 16 * 3 * 64 * 2 == 368_640


def test_cuda_budget_subtracts_memory_in_use_at_the_peak() -> None:
    # 24 GiB device; after the forward 6 GiB are in use, 5 GiB of them torch's (weights);
    # the forward peaked at 7 GiB allocated, so 8 GiB were in use at the peak.
    budget = kv_cache_bytes_cuda(
        total=24 * GIB,
        free=18 * GIB,
        allocated=5 * GIB,
        peak_allocated=7 * GIB,
        memory_utilization=0.5,
    )
    assert budget == 12 * GIB - 8 * GIB
    assert (
        kv_cache_bytes_cuda(
            total=24 * GIB,
            free=GIB,
            allocated=5 * GIB,
            peak_allocated=7 * GIB,
            memory_utilization=0.5,
        )
        == 0
    )


def test_cpu_budget_is_a_share_of_available_memory() -> None:
    assert kv_cache_bytes_cpu(available=10 * GIB, memory_utilization=0.9) == int(9 * GIB)


def test_memory_mapped_weights_are_counted_before_the_kv_cache() -> None:
    """A GGUF's converted weights are mapped from a file: psutil counts them as available
    (page cache, or pages not yet read), but every step reads them all."""
    mapped = kv_cache_bytes_cpu(available=10 * GIB, memory_utilization=0.9, reserved=6 * GIB)
    assert mapped == int(0.9 * 4 * GIB)
    assert kv_cache_bytes_cpu(available=5 * GIB, memory_utilization=0.9, reserved=6 * GIB) == 0
    assert _blocks(cpu_available=5 * GIB, cpu_reserved=4 * GIB) == GIB // 2 // BLOCK


MEASURED = ("cuda_mem_get_info", "cuda_allocated", "cuda_peak_allocated", "cpu_available")


def _sizing(**overrides: object) -> KVSizing:
    fields: dict = dict(
        block_bytes=BLOCK,
        device_type="cpu",
        memory_utilization=0.5,
        kv_cache_memory=None,
        max_model_len=4096,
        block_size=16,
    )
    fields.update(overrides)
    return KVSizing(**fields)


def _blocks(**overrides: object) -> int:
    """`num_kv_blocks` of the default sizing and 8 GiB available, with `overrides` (of the
    sizing's fields and of the measured figures)."""
    measured: dict = dict(cpu_available=8 * GIB)
    measured.update({name: value for name, value in overrides.items() if name in MEASURED})
    settings = {name: value for name, value in overrides.items() if name not in MEASURED}
    return num_kv_blocks(_sizing(**settings), **measured).num_blocks


def test_num_kv_blocks_cpu_and_kv_cache_memory_cap() -> None:
    assert _blocks() == CPU_DEFAULT_KV_CACHE_MEMORY // BLOCK  # unset: the CPU default
    assert _blocks(cpu_available=3 * GIB) == int(1.5 * GIB) // BLOCK  # or less if profiled
    assert _blocks(kv_cache_memory=GIB) == GIB // BLOCK  # caps the profiled budget ...
    assert _blocks(kv_cache_memory=100 * GIB) == 4 * GIB // BLOCK  # ... never raises it


def test_never_more_blocks_than_the_running_sequences_can_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="cache.profiling")
    # 4096 tokens are 256 blocks: 3 sequences use 768, and 1% more stay in reserve.
    assert _blocks(max_num_seqs=3, watermark=0.01) == int(768 / 0.99) + 1
    assert "max_num_seqs=3" in caplog.text
    assert _blocks(max_num_seqs=100) == CPU_DEFAULT_KV_CACHE_MEMORY // BLOCK  # not binding


def test_num_kv_blocks_cuda_from_measured_numbers() -> None:
    blocks = _blocks(
        device_type="cuda",
        cpu_available=None,
        memory_utilization=0.9,
        cuda_mem_get_info=(18 * GIB, 24 * GIB),
        cuda_allocated=5 * GIB,
        cuda_peak_allocated=7 * GIB,
    )
    assert blocks == (int(24 * GIB * 0.9) - 8 * GIB) // BLOCK
    with pytest.raises(ValueError, match="cuda_mem_get_info"):
        _blocks(device_type="cuda")
    with pytest.raises(ValueError, match="unsupported device"):
        _blocks(device_type="mps")


def test_too_small_names_the_setting_to_change() -> None:
    # 4096 tokens need 256 blocks = 90 MiB here.
    with pytest.raises(InsufficientKVCacheError, match="raise kv_cache_memory") as info:
        _blocks(kv_cache_memory=64 * MIB)
    assert "max_model_len=4096" in str(info.value) and "256 blocks" in str(info.value)
    with pytest.raises(InsufficientKVCacheError, match="raise memory_utilization"):
        _blocks(cpu_available=100 * MIB)
    assert _blocks(kv_cache_memory=256 * BLOCK) == 256  # exactly one sequence fits
    with pytest.raises(InsufficientKVCacheError, match="watermark"):
        _blocks(kv_cache_memory=256 * BLOCK, watermark=0.01)  # but not outside the reserve


def test_profile_num_blocks_reads_psutil_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_memory = SimpleNamespace(available=8 * GIB, total=16 * GIB)
    monkeypatch.setattr(cache.profiling.psutil, "virtual_memory", lambda: fake_memory)
    blocks = profile_num_blocks(_sizing()).num_blocks
    assert blocks == CPU_DEFAULT_KV_CACHE_MEMORY // BLOCK
    monkeypatch.setattr(fake_memory, "available", GIB)
    assert profile_num_blocks(_sizing()).num_blocks == GIB // 2 // BLOCK


def test_profile_num_blocks_reads_the_given_cuda_callables() -> None:
    blocks = profile_num_blocks(
        _sizing(
            device_type="cuda", memory_utilization=0.9, kv_cache_memory=2 * GIB, watermark=0.01
        ),
        cuda_mem_get_info=lambda: (18 * GIB, 24 * GIB),
        cuda_memory_stats=lambda: {
            "allocated_bytes.all.current": 5 * GIB,
            "allocated_bytes.all.peak": 7 * GIB,
        },
    ).num_blocks
    assert blocks == 2 * GIB // BLOCK
