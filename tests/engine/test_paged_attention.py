"""The two prefill attention paths (CPU einsum, SDPA for other devices) agree."""

from __future__ import annotations

import pytest
import torch

from engine.paged_attention import _attend_einsum, _attend_sdpa


@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize(("num_queries", "context_len"), [(1, 1), (5, 5), (7, 40)])
def test_einsum_and_sdpa_prefill_paths_match(group_size, num_queries, context_len):
    generator = torch.Generator().manual_seed(num_queries * 100 + context_len)
    num_kv_heads, head_dim = 2, 16
    q = torch.randn(num_queries, num_kv_heads * group_size, head_dim, generator=generator)
    keys = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
    query_pos = torch.arange(context_len - num_queries, context_len)
    mask = torch.arange(context_len)[None, :] <= query_pos[:, None]
    expected = _attend_sdpa(q, keys, values, mask, 0.25, group_size)
    actual = _attend_einsum(q, keys, values, mask, 0.25, group_size)
    assert actual.shape == (num_queries, num_kv_heads * group_size, head_dim)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
