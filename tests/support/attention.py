"""Paged attention's test cases: inputs laid out as the engine's KV tensor, an fp64
reference and the tolerances it is held to (the C++ kernel's and the Triton kernels' tests
share them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.model.attention_metadata import PagedAttentionMetadata

# With 16-token blocks: one token, a block minus one, a full block, one past it, and two
# partial third and fifth blocks.
LENGTHS = (1, 15, 16, 17, 45, 70)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@dataclass(slots=True)
class Case:
    """Attention inputs over layer 1 of a paged KV tensor laid out as the engine's:
    sequence b has `context_lens[b]` tokens and its last `queries[b]` are query rows. The
    kernel's optional features are off by default (see `with_features` in
    tests/engine/model/kernels/test_attention_kernel.py)."""

    kv_cache: torch.Tensor
    q: torch.Tensor
    block_tables: torch.Tensor
    context_lens: tuple[int, ...]
    queries: tuple[int, ...]
    scale: float
    sliding_window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[1, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[1, 1]

    @property
    def query_start(self) -> torch.Tensor:
        return torch.tensor((0, *np.cumsum(self.queries)), dtype=torch.int64)

    def metadata(self) -> PagedAttentionMetadata:
        starts = self.query_start
        lens = torch.tensor(self.context_lens, dtype=torch.int64)
        return PagedAttentionMetadata(
            kv_caches=(self.kv_cache,),
            slot_mapping=torch.empty(0, dtype=torch.int64),
            block_tables=self.block_tables,
            query_start=starts,
            context_lens=lens,
            query_start_host=starts.numpy(),
            context_lens_host=lens.numpy(),
            positions_host=np.concatenate(
                [np.arange(n - q, n) for n, q in zip(self.context_lens, self.queries, strict=True)]
            ),
            max_query_len=max(self.queries),
        )

    def select(self, sequence: int, first: int, end: int) -> Case:
        """Query rows [first, end) of one sequence (counted from its first query row) as a
        case of their own: the context ends at the last of them."""
        row0 = int(self.query_start[sequence])
        context_len = self.context_lens[sequence] - self.queries[sequence] + end
        return replace(
            self,
            q=self.q[row0 + first : row0 + end],
            block_tables=self.block_tables[sequence : sequence + 1],
            context_lens=(context_len,),
            queries=(end - first,),
        )


def make_case(
    lengths: tuple[int, ...],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    query_scale: float = 1.0,
    queries: tuple[int, ...] | None = None,
) -> Case:
    """Sequences get shuffled, non-contiguous blocks; the slots after each context's last
    token hold NaN and the table padding holds out-of-range ids, so reading either shows.
    `queries` defaults to one query row per sequence (a decode step)."""
    queries = queries or (1,) * len(lengths)
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
    q = torch.randn(sum(queries), num_heads, head_dim, generator=generator) * query_scale
    return Case(kv_cache, q.to(dtype), tables, tuple(lengths), tuple(queries), head_dim**-0.5)


def reference(case: Case) -> torch.Tensor:
    """Gather each row's visible tokens and take a plain softmax, in fp64, as transformers'
    eager attention does with the features: scores capped by tanh (Gemma 2), positions
    before the window masked out (`sliding_window_overlay`), and the sink logit appended
    as one more column of the softmax whose probability is then dropped (gpt-oss)."""
    block_size = case.k_cache.shape[1]
    group = case.q.shape[1] // case.k_cache.shape[2]
    rows = []
    for b, (length, queries) in enumerate(zip(case.context_lens, case.queries, strict=True)):
        blocks = case.block_tables[b, : math.ceil(length / block_size)]
        keys = case.k_cache[blocks].flatten(0, 1)[:length].double().repeat_interleave(group, 1)
        values = case.v_cache[blocks].flatten(0, 1)[:length].double().repeat_interleave(group, 1)
        for i in range(queries):
            position = length - queries + i
            q = case.q[int(case.query_start[b]) + i].double()
            scores = torch.einsum("hd,shd->hs", q, keys[: position + 1]) * case.scale
            if case.softcap:
                scores = torch.tanh(scores / case.softcap) * case.softcap
            if case.sliding_window:
                before = torch.arange(position + 1) <= position - case.sliding_window
                scores = scores.masked_fill(before, -math.inf)
            if case.sinks is not None:
                scores = torch.cat([scores, case.sinks.double()[:, None]], dim=-1)
            probs = scores.softmax(dim=-1)
            if case.sinks is not None:
                probs = probs[:, :-1]
            rows.append(torch.einsum("hs,shd->hd", probs, values[: position + 1]))
    return torch.stack(rows)


def assert_matches(actual: torch.Tensor, case: Case) -> None:
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    tolerance = FP32_TOL if case.q.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.double(), reference(case), **tolerance)
