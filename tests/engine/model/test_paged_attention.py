"""Prefill in the gathered torch path (CUDA's): causal over the chunk and its cached past."""

from __future__ import annotations

import pytest
import torch

from engine.model.torch_attention import attend_causal


def reference_attention(q, keys, values, scale, group_size):
    """Float64 softmax attention, query i at position S - Tq + i seeing keys up to it."""
    num_queries, context_len = q.shape[0], keys.shape[0]
    keys = keys.double().repeat_interleave(group_size, dim=1)
    values = values.double().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), keys) * scale
    query_pos = torch.arange(context_len - num_queries, context_len)
    visible = torch.arange(context_len)[None, :] <= query_pos[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, values)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize(
    ("num_queries", "context_len"), [(1, 1), (5, 5), (7, 40), (300, 300), (64, 600)]
)
def test_prefill_attention_matches_reference(
    dtype, tolerance, group_size, num_queries, context_len
):
    generator = torch.Generator().manual_seed(num_queries * 1000 + context_len)
    num_kv_heads, head_dim = 2, 32
    q = torch.randn(num_queries, num_kv_heads * group_size, head_dim, generator=generator)
    keys = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
    actual = attend_causal(q.to(dtype), keys.to(dtype), values.to(dtype), 0.2, group_size)
    assert actual.shape == q.shape and actual.dtype == dtype
    expected = reference_attention(q, keys, values, 0.2, group_size)
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)
