"""The Triton kernels against the fp64 reference and the torch store, on CUDA when present,
else on the CPU through Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA torch)")

from engine.model.kernels import triton_attention
from tests.support.attention import (
    BF16_TOL,
    FP32_TOL,
    LENGTHS,
    Case,
    assert_matches,
    make_case,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)


@dataclass(frozen=True)
class Options:
    """paged_attention's optional masks and logit changes; `sinks` draws one logit a head."""

    window: int = 0
    softcap: float = 0.0
    sinks: bool = False

    def sink_logits(self, num_heads: int) -> torch.Tensor | None:
        if not self.sinks:
            return None
        # Around the scores' own size, so that a sink takes a real share of some rows.
        return torch.randn(num_heads, generator=torch.Generator().manual_seed(5)) * 2 + 1

    def kwargs(self, num_heads: int) -> dict:
        sinks = self.sink_logits(num_heads)
        return dict(
            sliding_window=self.window,
            softcap=self.softcap,
            sinks=None if sinks is None else sinks.to(DEVICE),
        )


PLAIN = Options()


def run_triton(
    case: Case, max_query_len: int | None = None, options: Options = PLAIN
) -> torch.Tensor:
    out = triton_attention.paged_attention(
        case.q.to(DEVICE),
        case.k_cache.to(DEVICE),
        case.v_cache.to(DEVICE),
        case.block_tables.to(DEVICE),
        case.query_start.to(DEVICE),
        torch.tensor(case.context_lens, device=DEVICE),
        case.scale,
        max_query_len=max_query_len or max(case.queries),
        **options.kwargs(case.q.shape[1]),
    )
    return out.cpu()


def dense_reference(case: Case, options: Options) -> torch.Tensor:
    """Each row over its sequence's whole context as transformers' eager gemma2 and gpt-oss
    code does it, in fp64: scores, softcap, the causal and window mask added as -inf, the
    sink logit concatenated as one more column, softmax, the sink's column dropped."""
    block_size = case.k_cache.shape[1]
    group = case.q.shape[1] // case.k_cache.shape[2]
    sinks = options.sink_logits(case.q.shape[1])
    rows = []
    for b, (length, queries) in enumerate(zip(case.context_lens, case.queries, strict=True)):
        blocks = case.block_tables[b, : math.ceil(length / block_size)]
        keys = case.k_cache[blocks].flatten(0, 1)[:length].double().repeat_interleave(group, 1)
        values = case.v_cache[blocks].flatten(0, 1)[:length].double().repeat_interleave(group, 1)
        key_positions = torch.arange(length)
        for i in range(queries):
            position = length - queries + i
            q = case.q[int(case.query_start[b]) + i].double()
            scores = torch.einsum("hd,shd->hs", q, keys) * case.scale
            if options.softcap:
                scores = torch.tanh(scores / options.softcap) * options.softcap
            visible = key_positions <= position
            if options.window:
                visible &= key_positions > position - options.window
            scores = scores + torch.zeros(length).masked_fill(~visible, -math.inf).double()
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
            probs = scores.softmax(dim=-1)[:, :length]
            rows.append(torch.einsum("hs,shd->hd", probs, values))
    return torch.stack(rows)


def assert_matches_dense(actual: torch.Tensor, case: Case, options: Options) -> None:
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    tolerance = FP32_TOL if case.q.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.double(), dense_reference(case, options), **tolerance)


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


# Decode rows at positions 0, 16 and 39, whole prompts of one and several row
# tiles, and a 30-row chunk starting mid-block after a cached prefix, in one launch. With 6
# query heads over 2 KV heads a tile holds 8 rows and a padded 4th head a KV head.
OPTION_LENGTHS = (1, 17, 15, 45, 70, 40)
OPTION_QUERIES = (1, 1, 15, 30, 70, 1)
ALL = Options(window=19, softcap=4.0, sinks=True)


def options_case(dtype: torch.dtype, block_size: int = 16, seed: int = 11) -> Case:
    # Scores spread to about +-8, so a 4.0 softcap bends most of them.
    return make_case(
        OPTION_LENGTHS, 6, 2, 32, block_size, dtype, seed=seed, query_scale=2.0,
        queries=OPTION_QUERIES,
    )  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        Options(window=1),
        Options(window=5),
        Options(window=16),
        Options(window=40),
        Options(window=1000),
        Options(softcap=4.0),
        Options(softcap=50.0),
        Options(sinks=True),
        Options(window=5, sinks=True),
        ALL,
    ],
    ids=[
        "window1", "window5", "window16", "window40", "window-past-context", "softcap4",
        "softcap50", "sinks", "window5-sinks", "all",
    ],
)  # fmt: skip
def test_options_match_dense_reference(options: Options) -> None:
    case = options_case(torch.float32)
    assert_matches_dense(run_triton(case, options=options), case, options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_all_options_match_dense_reference_in_half_precision(dtype: torch.dtype) -> None:
    case = options_case(dtype)
    assert_matches_dense(run_triton(case, options=ALL), case, ALL)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["block-1", "block", "block+1"])
def test_windows_around_the_block_size(block_size: int, offset: int) -> None:
    case = options_case(torch.float32, block_size, seed=block_size + offset)
    options = Options(window=block_size + offset)
    assert_matches_dense(run_triton(case, options=options), case, options)


def test_options_change_the_output() -> None:
    """Each option's test above can fail: the window, softcap and sinks each move rows."""
    case = options_case(torch.float32)
    plain = run_triton(case)
    for options in (Options(window=16), Options(softcap=4.0), Options(sinks=True)):
        assert (run_triton(case, options=options) - plain).abs().max() > 0.05


def test_a_window_past_the_context_and_minus_inf_sinks_change_no_bit() -> None:
    """A window no row outgrows and a sink of -inf take nothing away and add nothing; with
    a narrow window, -inf sinks also meet rows that see nothing in the first block."""
    case = options_case(torch.float32)
    minus_inf = torch.full((6,), -math.inf, device=DEVICE)

    def run(**kwargs) -> torch.Tensor:
        return triton_attention.paged_attention(
            case.q.to(DEVICE),
            case.k_cache.to(DEVICE),
            case.v_cache.to(DEVICE),
            case.block_tables.to(DEVICE),
            case.query_start.to(DEVICE),
            torch.tensor(case.context_lens, device=DEVICE),
            case.scale,
            max(case.queries),
            **kwargs,
        ).cpu()

    plain = run()
    assert torch.equal(run(sliding_window=70), plain)
    assert torch.equal(run(sinks=minus_inf), plain)
    assert torch.equal(run(sliding_window=5, sinks=minus_inf), run(sliding_window=5))


def test_bad_options_are_refused() -> None:
    case = options_case(torch.float32)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start)
    lens = torch.tensor(case.context_lens)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_attention.paged_attention(*args, lens, case.scale, 70, sliding_window=-1)
    with pytest.raises(ValueError, match="softcap"):
        triton_attention.paged_attention(*args, lens, case.scale, 70, softcap=-1.0)
    for sinks in (torch.zeros(3), torch.zeros(6, dtype=torch.float64), torch.zeros(12)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            triton_attention.paged_attention(*args, lens, case.scale, 70, sinks=sinks)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_head_dims_of_real_models(head_dim: int) -> None:
    case = make_case((5, 40), 4, 2, head_dim, 16, torch.float32, seed=head_dim, queries=(5, 3))
    assert_matches(run_triton(case), case)


def test_peaked_scores_over_many_blocks() -> None:
    case = make_case((300, 1), 9, 3, 64, 16, torch.float32, seed=1, query_scale=8.0)
    assert_matches(run_triton(case), case)


INVARIANCE_OPTIONS = pytest.mark.parametrize(
    "options", [PLAIN, Options(window=11, softcap=4.0, sinks=True)], ids=["plain", "options"]
)


@INVARIANCE_OPTIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_launch(
    dtype: torch.dtype, options: Options
) -> None:
    """A 40-token prompt's rows, in one prefill, beside other sequences and in chunks cut
    at row-tile bounds (a row keeps its place in its tile): the same bits every time."""
    case = make_case((40, 33, 20), 9, 3, 64, 16, dtype, seed=7, queries=(40, 33, 1))
    whole = run_triton(case.select(0, 0, 40), options=options)
    assert torch.equal(run_triton(case, options=options)[:40], whole)
    chunks = [
        run_triton(case.select(0, a, b), options=options) for a, b in pairwise((0, 8, 32, 40))
    ]
    assert torch.equal(torch.cat(chunks), whole)


@pytest.mark.skipif(
    triton_attention.interpreted(),
    reason="the interpreter's numpy computes a row's last bits by its place in the tile",
)
@INVARIANCE_OPTIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_where_its_chunk_starts(
    dtype: torch.dtype, options: Options
) -> None:
    """With a window, a tile starts at its first row's first visible block: a row's bits
    do not depend on which block that is."""
    case = make_case((40,), 9, 3, 64, 16, dtype, seed=7, queries=(40,))
    whole = run_triton(case, options=options)
    cuts = pairwise((0, 5, 21, 22, 39, 40))
    chunks = [run_triton(case.select(0, a, b), options=options) for a, b in cuts]
    assert torch.equal(torch.cat(chunks), whole)
    decoded = [run_triton(case.select(0, i, i + 1), options=options) for i in range(0, 40, 7)]
    assert torch.equal(torch.cat(decoded), whole[::7])


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
