"""The Triton kernels against the fp64 reference and the torch store, on CUDA when present,
else on the CPU through Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA torch)")

from engine.model.kernels import triton_attention
from tests.engine.test_attention_kernel import (
    LENGTHS,
    Case,
    assert_matches,
    make_case,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)


def run_triton(case: Case, max_query_len: int | None = None) -> torch.Tensor:
    out = triton_attention.paged_attention(
        case.q.to(DEVICE),
        case.k_cache.to(DEVICE),
        case.v_cache.to(DEVICE),
        case.block_tables.to(DEVICE),
        case.query_start.to(DEVICE),
        torch.tensor(case.context_lens, device=DEVICE),
        case.scale,
        max_query_len=max_query_len or max(case.queries),
    )
    return out.cpu()


@DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "heads", [(4, 4), (9, 3), (8, 2), (14, 2), (16, 2)],
    ids=["gqa1", "gqa3", "gqa4", "gqa7", "gqa8"],
)  # fmt: skip
def test_decode_rows_match_reference(
    dtype: torch.dtype, block_size: int, heads: tuple[int, int]
) -> None:
    # Context lengths 1, a block minus one, a block, one past it, and partial blocks.
    case = make_case(LENGTHS, *heads, 64, block_size, dtype, seed=block_size + heads[0])
    assert_matches(run_triton(case), case)


@DTYPES
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
def test_prefill_chunks_and_decode_rows_match_reference(
    dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    # Whole prompts, chunks after a cached prefix (some starting mid-block), decode rows and
    # chunks longer than one program's row tile, in one launch.
    lengths = (1, 15, 16, 17, 45, 70, 40, 100)
    queries = (1, 15, 3, 1, 29, 70, 1, 37)
    case = make_case(lengths, *heads, 64, 16, dtype, seed=sum(heads), queries=queries)
    assert_matches(run_triton(case), case)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_head_dims_of_real_models(head_dim: int) -> None:
    case = make_case((5, 40), 4, 2, head_dim, 16, torch.float32, seed=head_dim, queries=(5, 3))
    assert_matches(run_triton(case), case)


def test_peaked_scores_over_many_blocks() -> None:
    case = make_case((300, 1), 9, 3, 64, 16, torch.float32, seed=1, query_scale=8.0)
    assert_matches(run_triton(case), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_launch(dtype: torch.dtype) -> None:
    """A 40-token prompt's rows, in one prefill, beside other sequences and in chunks cut
    at row-tile bounds (a row keeps its place in its tile): the same bits every time."""
    case = make_case((40, 33, 20), 9, 3, 64, 16, dtype, seed=7, queries=(40, 33, 1))
    whole = run_triton(case.select(0, 0, 40))
    assert torch.equal(run_triton(case)[:40], whole)
    chunks = [run_triton(case.select(0, a, b)) for a, b in pairwise((0, 8, 32, 40))]
    assert torch.equal(torch.cat(chunks), whole)


@pytest.mark.skipif(
    triton_attention.interpreted(),
    reason="the interpreter's numpy computes a row's last bits by its place in the tile",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_where_its_chunk_starts(dtype: torch.dtype) -> None:
    case = make_case((40,), 9, 3, 64, 16, dtype, seed=7, queries=(40,))
    whole = run_triton(case)
    chunks = [run_triton(case.select(0, a, b)) for a, b in pairwise((0, 5, 21, 22, 39, 40))]
    assert torch.equal(torch.cat(chunks), whole)
    decoded = torch.cat([run_triton(case.select(0, i, i + 1)) for i in range(0, 40, 7)])
    assert torch.equal(decoded, whole[::7])


def test_sequences_without_query_rows_in_a_padded_grid() -> None:
    # max_query_len larger than any chunk: the extra programs return without writing.
    case = make_case((17, 30), 4, 2, 64, 16, torch.float32, seed=3, queries=(1, 2))
    assert_matches(run_triton(case, max_query_len=64), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kv_writes_slots_and_skips_negative_ones(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    cache_shape = (2, 6, 16, 3, 64)  # K/V, blocks, slots, heads, dim
    kv = torch.randn(cache_shape, generator=generator).to(dtype)
    # [1, Hkv, T, D] as a model gives it, viewed as [T, Hkv, D]: token-strided, not contiguous
    key = torch.randn(1, 3, 5, 64, generator=generator).to(dtype)[0].transpose(0, 1)
    value = torch.randn(1, 3, 5, 64, generator=generator).to(dtype)[0].transpose(0, 1)
    slots = torch.tensor([17, 3, -1, 95, 40])
    expected = kv.clone()
    written = slots >= 0
    expected[0].view(-1, 3, 64)[slots[written]] = key[written]
    expected[1].view(-1, 3, 64)[slots[written]] = value[written]

    actual = kv.to(DEVICE)
    triton_attention.store_kv(
        key.to(DEVICE), value.to(DEVICE), actual[0], actual[1], slots.to(DEVICE)
    )
    assert torch.equal(actual.cpu(), expected)


def test_supports() -> None:
    assert triton_attention.supports(torch.bfloat16, 16)
    assert triton_attention.supports(torch.float16, 32)
    assert not triton_attention.supports(torch.float64, 16)
    assert not triton_attention.supports(torch.float32, 8)
    assert not triton_attention.supports(torch.float32, 24)
