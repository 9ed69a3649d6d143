"""Paged attention, C++ kernel and blockwise torch, against an fp64 reference, and the
invariance the engine's outputs rest on: a row's bits do not depend on the batch. The
kernel's sliding window, logit softcap and attention sinks are checked the same ways.

These tests build the kernel (once per machine, cached); where it cannot be built they
skip, naming the reason (test_kernel_build.py checks the fallback to torch attention).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.attention_metadata import AttentionFeatures
from engine.model.kernels import cpp_extension
from engine.model.kernels import paged_attention as kernel_module
from engine.model.kernels.paged_attention import (
    CppAttention,
    KernelUnavailableError,
    load_attention_kernel,
    unavailable_reason,
)
from engine.model.torch_attention import blockwise_attention, gathered_attention
from tests.support.attention import (
    BF16_TOL,
    FP32_TOL,
    LENGTHS,
    Case,
    assert_matches,
    make_case,
    reference,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def with_features(
    case: Case, sliding_window: int = 0, softcap: float = 0.0, sinks: bool = False
) -> Case:
    """The case with a window, a softcap and (if `sinks`) one sink logit per query head,
    spread around the scores' range (-4 to 8) so that some dominate a row's softmax."""
    num_heads = case.q.shape[1]
    sink_logits = torch.linspace(-4.0, 8.0, num_heads) if sinks else None
    return replace(case, sliding_window=sliding_window, softcap=softcap, sinks=sink_logits)


def run_kernel(case: Case) -> torch.Tensor:
    return paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start,
        torch.tensor(case.context_lens),
        case.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=case.sinks,
    )


def run_blockwise(case: Case) -> torch.Tensor:
    tables = case.block_tables.clamp(max=case.kv_cache.shape[2] - 1)  # it indexes whole rows
    return blockwise_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        replace(case, block_tables=tables).metadata(),
        case.scale,
    )


def skip_without_kernel() -> None:
    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"C++ kernel unavailable: {reason}")


def paged_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The kernel's `paged_attention`, or a skip where it cannot be built."""
    skip_without_kernel()
    return kernel_module.paged_attention(*args, **kwargs)


IMPLEMENTATIONS = pytest.mark.parametrize(
    "attend", [run_kernel, run_blockwise], ids=["cpp", "blockwise"]
)


@DTYPES
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "heads", [(4, 4), (4, 2), (9, 3), (8, 2), (10, 2), (14, 2), (16, 2)],
    ids=["gqa1", "gqa2", "gqa3", "gqa4", "gqa5", "gqa7", "gqa8"],
)  # fmt: skip
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_rows_match_reference(
    dtype: torch.dtype, block_size: int, heads: tuple[int, int], head_dim: int
) -> None:
    case = make_case(LENGTHS, *heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    assert_matches(run_kernel(case), case)


@IMPLEMENTATIONS
@DTYPES
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
def test_prefill_chunks_and_decode_rows_match_reference(
    attend: Callable[[Case], torch.Tensor], dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    # Whole prompts, chunks after a cached prefix (some starting mid-block), decode rows,
    # and a chunk longer than one row tile of the kernel, in one step.
    lengths = (1, 15, 16, 17, 45, 70, 40, 100)
    queries = (1, 15, 3, 1, 29, 70, 1, 37)
    case = make_case(lengths, *heads, 64, 16, dtype, seed=sum(heads), queries=queries)
    assert_matches(attend(case), case)


@DTYPES
def test_long_contexts_with_peaked_scores(dtype: torch.dtype) -> None:
    # Large query norms make the running max move between tiles many times over.
    case = make_case((1000, 333, 1), 9, 3, 64, 16, dtype, seed=1, query_scale=8.0)
    assert_matches(run_kernel(case), case)
    case = make_case((120, 40), 9, 3, 64, 16, dtype, seed=2, query_scale=8.0, queries=(120, 7))
    assert_matches(run_kernel(case), case)


@IMPLEMENTATIONS
@DTYPES
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "gqa1"])
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_step(
    attend: Callable[[Case], torch.Tensor], dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    """Each row of a 70-token prompt, computed in one prefill, in chunks split anywhere,
    as a decode row, and beside other sequences' rows, has the same bits every time."""
    case = make_case((70, 33, 20), *heads, 64, 16, dtype, seed=7, queries=(70, 33, 1))
    whole = attend(case.select(0, 0, 70))
    assert torch.equal(attend(case)[:70], whole)  # beside a prefill and a decode row
    for cuts in ((0, 16, 32, 48, 64, 70), (0, 5, 21, 22, 60, 70), (0, 69, 70)):
        chunks = [attend(case.select(0, a, b)) for a, b in pairwise(cuts)]
        assert torch.equal(torch.cat(chunks), whole), cuts
    decoded = torch.cat([attend(case.select(0, i, i + 1)) for i in range(70)])
    assert torch.equal(decoded, whole)


@DTYPES
def test_the_kernel_and_the_torch_paths_agree(dtype: torch.dtype) -> None:
    lengths, queries = (1, 15, 16, 17, 45, 70), (1, 15, 1, 2, 1, 33)
    case = make_case(lengths, 9, 3, 64, 16, dtype, queries=queries)
    case.kv_cache = torch.nan_to_num(case.kv_cache)  # the gathered path reads padding slots
    case.block_tables = case.block_tables.clamp(max=case.kv_cache.shape[2] - 1)
    tolerance = FP32_TOL if dtype == torch.float32 else BF16_TOL
    gathered = gathered_attention(case.q, case.k_cache, case.v_cache, case.metadata(), case.scale)
    torch.testing.assert_close(run_kernel(case), gathered, **tolerance)
    torch.testing.assert_close(run_blockwise(case), gathered, **tolerance)


def test_other_head_dims_of_real_models() -> None:
    # 512: Gemma 4's global layers.
    for head_dim in (96, 256, 512):
        for dtype in (torch.float32, torch.bfloat16):
            case = make_case((5, 40), 4, 2, head_dim, 16, dtype, seed=head_dim)
            assert_matches(run_kernel(case), case)


def test_int32_tables_and_lengths_give_the_same_result() -> None:
    case = make_case(LENGTHS, 9, 3, 64, 16, torch.float32, queries=(1, 15, 2, 1, 1, 9))
    narrow = paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables.int(),
        case.query_start.int(),
        torch.tensor(case.context_lens, dtype=torch.int32),
        case.scale,
    )
    assert torch.equal(narrow, run_kernel(case))


def test_result_does_not_depend_on_the_thread_count() -> None:
    case = make_case(LENGTHS * 3, 9, 3, 64, 16, torch.bfloat16, queries=(1, 15, 2) * 6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_kernel(case)
        torch.set_num_threads(4)  # the suite's workers may run on one thread each
        several = run_kernel(case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(several, single)


def test_strided_query_is_accepted() -> None:
    case = make_case(LENGTHS, 9, 3, 64, 16, torch.float32)
    case.q = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not case.q.is_contiguous()
    assert_matches(run_kernel(case), case)


def test_empty_batch() -> None:
    case = make_case((3,), 9, 3, 64, 16, torch.float32)
    empty = torch.zeros(0, dtype=torch.int64)
    out = paged_attention(
        case.q[:0],
        case.k_cache,
        case.v_cache,
        case.block_tables[:0],
        torch.zeros(1),
        empty,
        1.0,
    )
    assert out.shape == (0, 9, 64)


# Features: a sliding window (from one token to past every context, through the block
# sizes), a softcap, sinks, and all three at once.
FEATURES = pytest.mark.parametrize(
    "features",
    [
        dict(sliding_window=5),
        dict(sliding_window=16),
        dict(sliding_window=23),
        dict(softcap=5.0),
        dict(sinks=True),
        dict(sliding_window=9, softcap=5.0, sinks=True),
    ],
    ids=["window5", "window16", "window23", "softcap", "sinks", "all"],
)
# Whole prompts, chunks after a cached prefix (starting mid-block, and longer than one row
# tile of the kernel), and decode rows, in one step.
FEATURE_LENGTHS = (1, 15, 16, 17, 45, 70, 40, 100)
FEATURE_QUERIES = (1, 15, 3, 1, 29, 70, 1, 37)


def poison_before_windows(case: Case) -> Case:
    """A copy whose K/V slots before the first query row's window hold NaN, and whose
    table entries for blocks wholly before it hold out-of-range ids: a kernel that read
    either, or let a masked token's value through, shows it."""
    if not case.sliding_window:
        return case
    block_size = case.k_cache.shape[1]
    kv_cache, tables = case.kv_cache.clone(), case.block_tables.clone()
    for b, (length, queries) in enumerate(zip(case.context_lens, case.queries, strict=True)):
        first_visible = max(0, length - queries - case.sliding_window + 1)
        for t in range(first_visible):
            kv_cache[1, :, tables[b, t // block_size], t % block_size] = math.nan
        tables[b, : first_visible // block_size] = kv_cache.shape[2] + 100
    return replace(case, kv_cache=kv_cache, block_tables=tables)


def assert_features_match(case: Case) -> None:
    """The kernel, reading a case poisoned before its windows, against the reference."""
    expected = reference(case)
    actual = run_kernel(poison_before_windows(case))
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    tolerance = FP32_TOL if case.q.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.double(), expected, **tolerance)


@DTYPES
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [1, 5, 8, 16, 17, 40, 70, 1000])
@pytest.mark.parametrize("heads", [(9, 3), (16, 2)], ids=["gqa3", "gqa8"])
def test_sliding_window_matches_reference(
    dtype: torch.dtype, block_size: int, window: int, heads: tuple[int, int]
) -> None:
    # Windows of one token, smaller than, equal to and larger than a block, equal to some
    # contexts (16, 17, 40, 70) and larger than all of them.
    case = make_case(
        FEATURE_LENGTHS, *heads, 64, block_size, dtype, seed=window, queries=FEATURE_QUERIES
    )
    assert_features_match(with_features(case, sliding_window=window))


@DTYPES
@pytest.mark.parametrize("query_scale", [1.0, 8.0])
@pytest.mark.parametrize("heads", [(4, 4), (16, 2)], ids=["gqa1", "gqa8"])
def test_softcap_matches_reference(
    dtype: torch.dtype, query_scale: float, heads: tuple[int, int]
) -> None:
    # With query_scale 8 the scores' spread (about 8) is well past the cap: most are capped.
    case = make_case(
        FEATURE_LENGTHS, *heads, 64, 16, dtype, seed=3, query_scale=query_scale,
        queries=FEATURE_QUERIES,
    )  # fmt: skip
    assert_features_match(with_features(case, softcap=5.0))


@DTYPES
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
def test_sinks_match_reference(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    case = make_case(FEATURE_LENGTHS, *heads, 64, 16, dtype, seed=4, queries=FEATURE_QUERIES)
    assert_features_match(with_features(case, sinks=True))
    # A sink far below every score changes nothing the tolerance sees; one far above
    # takes nearly all the weight, so the output nearly vanishes.
    case.sinks = torch.full((heads[0],), -100.0)
    assert_features_match(case)
    case.sinks = torch.full((heads[0],), 100.0)
    assert run_kernel(case).abs().max() < 1e-20


@DTYPES
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [1, 6, 16, 40])
@pytest.mark.parametrize("heads", [(9, 3), (16, 2)], ids=["gqa3", "gqa8"])
def test_all_features_together_match_reference(
    dtype: torch.dtype, block_size: int, window: int, heads: tuple[int, int]
) -> None:
    case = make_case(
        FEATURE_LENGTHS, *heads, 64, block_size, dtype, seed=5, query_scale=4.0,
        queries=FEATURE_QUERIES,
    )  # fmt: skip
    assert_features_match(with_features(case, sliding_window=window, softcap=5.0, sinks=True))


@DTYPES
@pytest.mark.parametrize("window", [0, 6, 40])
def test_the_torch_paths_take_the_features_too(dtype: torch.dtype, window: int) -> None:
    # The CPU's blockwise path and CUDA's gathered one (decode rows batched, prefill chunks
    # by SDPA, or by hand with a softcap or sinks), run here on the CPU.
    case = make_case(
        FEATURE_LENGTHS, 9, 3, 64, 16, dtype, seed=6, query_scale=4.0, queries=FEATURE_QUERIES
    )
    case = with_features(case, sliding_window=window, softcap=5.0 if window else 0.0, sinks=True)
    case.kv_cache = torch.nan_to_num(case.kv_cache)  # the gathered path reads padding slots
    case.block_tables = case.block_tables.clamp(max=case.kv_cache.shape[2] - 1)
    features = AttentionFeatures(case.sliding_window, case.softcap, case.sinks)
    expected = reference(case)
    meta = case.metadata()
    tolerance = FP32_TOL if dtype == torch.float32 else BF16_TOL
    actual = blockwise_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, features)
    torch.testing.assert_close(actual.double(), expected, **tolerance)
    # The gathered path rounds the probabilities to bf16 before weighting V, as SDPA does:
    # with these peaked scores that alone moves a bf16 output by up to 0.025.
    tolerance = FP32_TOL if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    actual = gathered_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, features)
    torch.testing.assert_close(actual.double(), expected, **tolerance)
    # Window only (SDPA with a mask, no hand-computed scores), then nothing.
    for only in (AttentionFeatures(sliding_window=window), AttentionFeatures()):
        plain = replace(case, sliding_window=only.sliding_window, softcap=0.0, sinks=None)
        actual = gathered_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, only)
        torch.testing.assert_close(actual.double(), reference(plain), **tolerance)


@pytest.mark.parametrize("features", [dict(sliding_window=7, softcap=5.0, sinks=True)])
def test_features_with_other_head_dims(features: dict[str, Any]) -> None:
    for head_dim in (32, 128, 256):
        case = make_case((5, 40, 33), 4, 2, head_dim, 16, torch.float32, seed=head_dim,
                         queries=(5, 1, 20))  # fmt: skip
        assert_features_match(with_features(case, **features))


@DTYPES
@FEATURES
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "gqa1"])
def test_a_rows_bits_with_features_do_not_depend_on_the_rest_of_the_step(
    dtype: torch.dtype, features: dict[str, Any], heads: tuple[int, int]
) -> None:
    """As the test without features: each row of a 70-token prompt, computed in one
    prefill, in chunks split anywhere, as a decode row, and beside other sequences' rows,
    has the same bits every time, with a window, a softcap and sinks."""
    case = make_case((70, 33, 20), *heads, 64, 16, dtype, seed=7, queries=(70, 33, 1))
    case = poison_before_windows(with_features(case, **features))
    whole = run_kernel(case.select(0, 0, 70))
    assert torch.equal(run_kernel(case)[:70], whole)  # beside a prefill and a decode row
    for cuts in ((0, 16, 32, 48, 64, 70), (0, 5, 21, 22, 60, 70), (0, 69, 70), (0, 30, 70)):
        chunks = [run_kernel(case.select(0, a, b)) for a, b in pairwise(cuts)]
        assert torch.equal(torch.cat(chunks), whole), cuts
    decoded = torch.cat([run_kernel(case.select(0, i, i + 1)) for i in range(70)])
    assert torch.equal(decoded, whole)


@DTYPES
def test_features_at_their_neutral_values_change_no_bit(dtype: torch.dtype) -> None:
    """A window no context reaches and sinks of -inf give the plain kernel's bits (a
    window shorter than the tables' 128 positions runs the instantiation with features):
    they only ever add or drop zeros."""
    case = make_case(FEATURE_LENGTHS, 9, 3, 64, 16, dtype, seed=6, queries=FEATURE_QUERIES)
    assert case.block_tables.shape[1] * 16 == 128
    plain = run_kernel(case)
    for window in (100, 127, 128, 2**62):
        assert torch.equal(run_kernel(replace(case, sliding_window=window)), plain)
    assert torch.equal(run_kernel(replace(case, sinks=torch.full((9,), -math.inf))), plain)


def test_registered_op_takes_the_features() -> None:
    """`torch.ops.pagedserve.paged_attention` (the `cpp` backend's path), the pybind
    function called positionally and the backend itself give the wrapper's bits."""
    skip_without_kernel()
    kernel_module.register_kernel_ops()
    case = make_case(FEATURE_LENGTHS, 9, 3, 64, 16, torch.bfloat16, seed=8, queries=FEATURE_QUERIES)
    case = with_features(case, sliding_window=9, softcap=5.0, sinks=True)
    expected = run_kernel(case)
    lens = torch.tensor(case.context_lens)
    tables, starts = case.block_tables, case.query_start
    op = torch.ops.pagedserve.paged_attention(
        case.q, case.kv_cache, 1, tables, starts, lens, case.scale, 9, 5.0, case.sinks
    )
    assert torch.equal(op, expected)
    kernel = load_attention_kernel()
    assert kernel is not None
    positional = kernel(
        case.q, case.k_cache, case.v_cache, tables, starts, lens, case.scale, 9, 5.0, case.sinks
    )
    assert torch.equal(positional, expected)
    backend = CppAttention(torch.device("cpu"))  # the engine's path, eager and compiled
    features = AttentionFeatures(sliding_window=9, softcap=5.0, sinks=case.sinks)
    attended = backend.attend(case.q, case.kv_cache, 1, case.metadata(), case.scale, features)
    assert torch.equal(attended, expected)
    plain = torch.ops.pagedserve.paged_attention(
        case.q, case.kv_cache, 1, tables, starts, lens, case.scale, 0, 0.0, None
    )
    assert torch.equal(plain, run_kernel(replace(case, sliding_window=0, softcap=0.0, sinks=None)))


def test_the_backend_names_what_the_kernel_does_not_take() -> None:
    cpu = torch.device("cpu")
    reason = CppAttention.unavailable_reason
    assert "runs on the CPU, not on cuda" in reason(torch.device("cuda"), torch.float32, 64, 16)
    assert "float32 or bfloat16, not torch.float16" in reason(cpu, torch.float16, 64, 16)
    assert "head sizes 32, 64, 96, 128, 256, 512, not 80" in reason(cpu, torch.float32, 80, 16)
    for dtype, head_size in ((torch.bfloat16, 64), (torch.float32, 128)):
        assert reason(cpu, dtype, head_size, 16) == unavailable_reason()  # the build's, if any


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
        (dict(query_start=torch.tensor([0, 1, 3])), "query_start"),
        (dict(query_start=torch.tensor([0, 2, 2])), "query rows"),
        (dict(query_start=torch.tensor([0, 1])), "query_start"),
        (
            dict(
                context_lens=torch.tensor([20, 5]),
                q=torch.zeros(7, 9, 64),
                query_start=torch.tensor([0, 1, 7]),
            ),
            "6 query rows for a context of 5",
        ),
    ],
)
def test_rejects_inconsistent_inputs(change: dict[str, torch.Tensor], message: str) -> None:
    inputs = dict(
        q=torch.zeros(2, 9, 64),
        k_cache=torch.zeros(4, 16, 3, 64),
        v_cache=torch.zeros(4, 16, 3, 64),
        block_tables=torch.tensor([[0, 1], [2, 3]]),
        query_start=torch.tensor([0, 1, 2]),
        context_lens=torch.tensor([20, 5]),
    )
    inputs.update(change)
    with pytest.raises(RuntimeError, match=message):
        paged_attention(**inputs, scale=1.0)


@pytest.mark.parametrize(
    ("features", "message"),
    [
        (dict(sliding_window=-1), "sliding_window must be >= 0"),
        (dict(softcap=-1.0), "softcap must be finite and >= 0"),
        (dict(softcap=math.inf), "softcap must be finite and >= 0"),
        (dict(softcap=math.nan), "softcap must be finite and >= 0"),
        (dict(sinks=torch.zeros(8)), r"sinks must be \[H\] = \[9\]"),
        (dict(sinks=torch.zeros(1, 9)), r"sinks must be \[H\]"),
        (dict(sinks=torch.zeros(9, dtype=torch.float64)), "sinks must be float32"),
        (dict(sinks=torch.zeros(9, dtype=torch.bfloat16)), "sinks must be float32"),
        (dict(sinks=torch.zeros(9, device="meta")), "sinks must be on the CPU"),
    ],
)
def test_rejects_bad_features(features: dict[str, Any], message: str) -> None:
    cache = torch.zeros(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match=message):
        paged_attention(
            torch.zeros(2, 9, 64), cache, cache, torch.tensor([[0, 1], [2, 3]]),
            torch.tensor([0, 1, 2]), torch.tensor([20, 5]), 1.0, **features,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float16, 64), (torch.float64, 64), (torch.float32, 80)]
)
def test_rejects_unsupported_kinds(dtype: torch.dtype, head_dim: int) -> None:
    cache = torch.zeros(2, 16, 1, head_dim, dtype=dtype)
    q = torch.zeros(1, 1, head_dim, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16|head_dim"):
        one = torch.tensor([3])
        paged_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([0, 1]), one, 1.0)


def test_loader_degrades_to_none_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setattr(kernel_module.EXTENSION, "_result", None)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))  # no library built before
    monkeypatch.setenv("CXX", "no-such-compiler-pagedserve")
    with caplog.at_level(logging.WARNING, logger=cpp_extension.__name__):
        assert load_attention_kernel() is None
        assert load_attention_kernel() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no-such-compiler-pagedserve" in warnings[0].getMessage()
    with pytest.raises(KernelUnavailableError, match="no C\\+\\+ compiler"):
        kernel_module.paged_attention(*[torch.zeros(1)] * 6, scale=1.0)


def test_a_stamped_library_loads_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As in the container image: built elsewhere, loaded by a new process with no compiler."""
    skip_without_kernel()  # builds it in the real cache, or finds it there
    built = kernel_module.EXTENSION.build_directory()
    shutil.copytree(built, tmp_path / "kernels" / built.name)
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path), "CXX": "no-such-compiler-pagedserve"}
    check = (
        "import torch; "
        "from engine.model.kernels.paged_attention import paged_attention as f; "
        "c = torch.ones(2, 16, 1, 32); t = torch.tensor; "
        "out = f(torch.ones(1, 2, 32), c, c * 3, t([[1]]), t([0, 1]), t([5]), 1.0); "
        "assert torch.equal(out, torch.full((1, 2, 32), 3.0)), out"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # A stamp from another source (an edited kernel) sends the loader back to the compiler.
    (tmp_path / "kernels" / built.name / cpp_extension.STAMP_NAME).write_text("0" * 64)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-pagedserve")
    monkeypatch.setattr(kernel_module.EXTENSION, "_result", None)
    assert load_attention_kernel() is None
