"""The C++ paged decode-attention kernel against a gather-and-softmax reference in fp64.

These tests build the kernel (once per machine, cached) and fail if it cannot be built:
the test machine has a compiler. Only the loader degrades gracefully.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.model.attention import _decode_attention
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.kernels import decode_attention
from engine.model.kernels.decode_attention import (
    KernelUnavailableError,
    load_decode_kernel,
    paged_decode_attention,
    supports,
)

# With 16-token blocks: one token, a block minus one, a full block, one past it, and two
# partial third and fifth blocks.
LENGTHS = (1, 15, 16, 17, 45, 70)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@dataclass(slots=True)
class Case:
    """Decode inputs over layer 1 of a paged KV tensor laid out as the engine's."""

    kv_cache: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float


def make_case(
    lengths: tuple[int, ...],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    query_scale: float = 1.0,
) -> Case:
    """Rows get shuffled, non-contiguous blocks; the slots after each row's last token
    hold NaN and the table padding holds out-of-range ids, so reading either shows."""
    generator = torch.Generator().manual_seed(seed)
    used = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(used) + 7
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)  # [layers, K/V, ...]
    kv_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.full((len(lengths), max(used) + 1), num_blocks + 100, dtype=torch.int64)
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    for row, (length, count) in enumerate(zip(lengths, used, strict=True)):
        tables[row, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
        last = int(tables[row, count - 1])
        kv_cache[1, :, last, length - (count - 1) * block_size :] = math.nan
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator) * query_scale
    return Case(
        kv_cache=kv_cache,
        q=q.to(dtype),
        k_cache=kv_cache[1, 0],
        v_cache=kv_cache[1, 1],
        block_tables=tables,
        context_lens=torch.tensor(lengths, dtype=torch.int64),
        scale=head_dim**-0.5,
    )


def reference(case: Case) -> torch.Tensor:
    """Gather each row's tokens and take a plain softmax, in fp64."""
    block_size = case.k_cache.shape[1]
    group = case.q.shape[1] // case.k_cache.shape[2]
    rows = []
    for b, length in enumerate(case.context_lens.tolist()):
        blocks = case.block_tables[b, : math.ceil(length / block_size)]
        keys = case.k_cache[blocks].flatten(0, 1)[:length].double()
        values = case.v_cache[blocks].flatten(0, 1)[:length].double()
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", case.q[b].double(), keys) * case.scale
        rows.append(torch.einsum("hs,shd->hd", scores.softmax(dim=-1), values))
    return torch.stack(rows)


def run(case: Case) -> torch.Tensor:
    return paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale
    )


def assert_matches(actual: torch.Tensor, case: Case) -> None:
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    tolerance = FP32_TOL if case.q.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.double(), reference(case), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "heads", [(4, 4), (4, 2), (9, 3), (8, 2), (10, 2), (14, 2), (16, 2)],
    ids=["gqa1", "gqa2", "gqa3", "gqa4", "gqa5", "gqa7", "gqa8"],
)  # fmt: skip
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_matches_reference(
    dtype: torch.dtype, block_size: int, heads: tuple[int, int], head_dim: int
) -> None:
    case = make_case(LENGTHS, *heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    assert_matches(run(case), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_with_peaked_scores(dtype: torch.dtype) -> None:
    # Large query norms make the running max move between tiles many times over.
    case = make_case((1000, 333, 1), 9, 3, 64, 16, dtype, seed=1, query_scale=8.0)
    assert_matches(run(case), case)


def test_other_head_dims_of_real_models() -> None:
    for head_dim in (96, 256):
        case = make_case((5, 40), 4, 2, head_dim, 16, torch.float32, seed=head_dim)
        assert_matches(run(case), case)


def test_int32_tables_and_lengths_give_the_same_result() -> None:
    case = make_case(LENGTHS, 9, 3, 64, 16, torch.float32)
    narrow = paged_decode_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables.int(),
        case.context_lens.int(),
        case.scale,
    )
    torch.testing.assert_close(narrow, run(case), atol=0, rtol=0)


def test_result_does_not_depend_on_the_thread_count() -> None:
    case = make_case(LENGTHS * 3, 9, 3, 64, 16, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(case)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(run(case), single, atol=0, rtol=0)


def test_strided_query_is_accepted() -> None:
    case = make_case(LENGTHS, 9, 3, 64, 16, torch.float32)
    case.q = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not case.q.is_contiguous()
    assert_matches(run(case), case)


def test_empty_batch() -> None:
    case = make_case((3,), 9, 3, 64, 16, torch.float32)
    out = paged_decode_attention(
        case.q[:0], case.k_cache, case.v_cache, case.block_tables[:0], case.context_lens[:0], 1.0
    )
    assert out.shape == (0, 9, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_torch_decode_path(dtype: torch.dtype) -> None:
    case = make_case(LENGTHS, 9, 3, 64, 16, dtype)
    kv_cache = torch.nan_to_num(case.kv_cache)  # the torch path reads the padding slots
    k_cache, v_cache = kv_cache[1]
    metadata = PagedAttentionMetadata(
        kv_cache=kv_cache,
        slot_mapping=torch.empty(0, dtype=torch.int64),
        decode_token_index=torch.arange(len(LENGTHS)),
        decode_block_tables=case.block_tables.clamp(max=kv_cache.shape[2] - 1),
        decode_context_lens=case.context_lens,
        prefills=[],
    )
    expected = _decode_attention(case.q, k_cache, v_cache, metadata, case.scale)
    actual = paged_decode_attention(
        case.q, k_cache, v_cache, case.block_tables, case.context_lens, case.scale
    )
    tolerance = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual, expected, **tolerance)


def test_supports() -> None:
    cpu = torch.device("cpu")
    assert supports(torch.bfloat16, 64, cpu) and supports(torch.float32, 128, cpu)
    assert not supports(torch.float16, 64, cpu)
    assert not supports(torch.float32, 80, cpu)
    assert not supports(torch.float32, 64, torch.device("cuda"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(context_lens=torch.tensor([0, 5])), "outside"),
        (dict(context_lens=torch.tensor([5, 1000])), "outside"),
        (dict(block_tables=torch.tensor([[0, 1], [99, 2]])), "not a block"),
        (dict(block_tables=torch.tensor([[0, 1], [-1, 2]])), "not a block"),
        (dict(q=torch.zeros(2, 9, 64, dtype=torch.bfloat16)), "one dtype"),
        (dict(q=torch.zeros(2, 9, 32)), "head_dim"),
        (dict(q=torch.zeros(2, 8, 64)), "multiple"),
        (dict(q=torch.zeros(2, 9, 64, dtype=torch.float64)), "one dtype"),
        (dict(block_tables=torch.zeros(3, 2, dtype=torch.int64)), "block_tables"),
    ],
)
def test_rejects_inconsistent_inputs(change: dict[str, torch.Tensor], message: str) -> None:
    inputs = dict(
        q=torch.zeros(2, 9, 64),
        k_cache=torch.zeros(4, 16, 3, 64),
        v_cache=torch.zeros(4, 16, 3, 64),
        block_tables=torch.tensor([[0, 1], [2, 3]]),
        context_lens=torch.tensor([20, 5]),
    )
    inputs.update(change)
    with pytest.raises(RuntimeError, match=message):
        paged_decode_attention(**inputs, scale=1.0)


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float16, 64), (torch.float64, 64), (torch.float32, 80)]
)
def test_rejects_unsupported_kinds(dtype: torch.dtype, head_dim: int) -> None:
    cache = torch.zeros(2, 16, 1, head_dim, dtype=dtype)
    q = torch.zeros(1, 1, head_dim, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16|head_dim"):
        paged_decode_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([3]), 1.0)


def test_loader_degrades_to_none_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setattr(decode_attention, "_result", None)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))  # no library built before
    monkeypatch.setenv("CXX", "no-such-compiler-pagedserve")
    with caplog.at_level(logging.WARNING, logger=decode_attention.__name__):
        assert load_decode_kernel() is None
        assert load_decode_kernel() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no-such-compiler-pagedserve" in warnings[0].getMessage()
    with pytest.raises(KernelUnavailableError, match="no C\\+\\+ compiler"):
        paged_decode_attention(*[torch.zeros(1)] * 5, scale=1.0)


def test_a_stamped_library_loads_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As in the container image: built elsewhere, loaded by a new process with no compiler."""
    assert load_decode_kernel() is not None  # built (or found) in the real cache
    built = decode_attention.build_directory()
    shutil.copytree(built, tmp_path / "kernels" / built.name)
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path), "CXX": "no-such-compiler-pagedserve"}
    check = (
        "import torch; "
        "from engine.model.kernels.decode_attention import paged_decode_attention as f; "
        "c = torch.ones(2, 16, 1, 32); "
        "out = f(torch.ones(1, 2, 32), c, c * 3, torch.tensor([[1]]), torch.tensor([5]), 1.0); "
        "assert torch.equal(out, torch.full((1, 2, 32), 3.0)), out"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # A stamp from another source (an edited kernel) sends the loader back to the compiler.
    (tmp_path / "kernels" / built.name / decode_attention.STAMP_NAME).write_text("0" * 64)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-pagedserve")
    monkeypatch.setattr(decode_attention, "_result", None)
    assert load_decode_kernel() is None
