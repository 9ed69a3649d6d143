"""The `torch` attention backend (`TorchAttention`): paged attention in plain torch, on any
device, for where no kernel runs (see `engine.model.attention_backend`).

Both functions take the step's packed query rows `q [T, H, D]`, one layer's caches
`[num_blocks, block_size, Hkv, D]` and the step's `PagedAttentionMetadata`, and return
`[T, H, D]`: for the row at position p, softmax(scale * q . K^T) V over positions 0..p of
its sequence, with the layer's `AttentionFeatures` (window, softcap, sinks) applied.

- `blockwise_attention` is the backend's attention on the CPU. It computes every row,
  decoded or prefilled, with the arithmetic of the C++ kernel's contract (not its bits):
  one KV block at a time from block 0, folded into an online softmax, in fp32. Every op is
  elementwise or reduces over a fixed-size axis (head_dim, block_size), so a row's bits
  do not depend on the other rows of the step. Elementwise torch ops compute the last
  elements of a tensor that does not fill whole vectors with scalar code (whose exp()
  can differ from the vector one in the last bit), so the rows are padded to a multiple
  of `ROW_MULTIPLE`, which makes every tensor here fill whole vectors. It loops over
  blocks in Python: made for correctness on any CPU, not for long prompts.
- `gathered_attention` is its attention elsewhere (CUDA): decode rows gather their blocks
  and attend in one batched einsum, prefill chunks go through
  `scaled_dot_product_attention`. Fast there, but its reductions depend on the padded
  batch shape and on the kernels cuBLAS and SDPA pick, so a row's bits can depend on
  what else runs (see the README's "Deterministic outputs").
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.attention_metadata import (
    AttentionFeatures,
    DecodePrefillSplit,
    PagedAttentionMetadata,
)

NO_FEATURES = AttentionFeatures()

# Rows times heads times block_size then fills 64-float vectors for any head count.
ROW_MULTIPLE = 8


class TorchAttention:
    """The `torch` backend: K/V stored by `index_copy_`, attention by `function`,
    `blockwise_attention` on the CPU (row-invariant) and `gathered_attention` elsewhere.
    Both read the metadata's host arrays, so it runs neither compiled nor captured; every
    slot it stores is valid."""

    name = "torch"
    compiles = False
    captures = False

    def __init__(self, device: torch.device) -> None:
        self.function = blockwise_attention if device.type == "cpu" else gathered_attention

    @staticmethod
    def unavailable_reason(
        device: torch.device, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        """None: plain torch runs on every device, dtype and shape."""
        return None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
    ) -> None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        k_cache, v_cache = kv_cache[layer]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: PagedAttentionMetadata,
        scale: float,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[layer]
        return self.function(q, k_cache, v_cache, meta, scale, features)


def blockwise_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    features: AttentionFeatures = NO_FEATURES,
) -> torch.Tensor:
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    counts = torch.from_numpy(np.diff(meta.query_start_host))
    seq_of_row = torch.arange(len(counts)).repeat_interleave(counts)
    positions = torch.from_numpy(meta.positions_host)
    last_block = int(positions.max()) // block_size if rows else -1
    window = features.sliding_window
    first_block = max(0, int(positions.min()) - window + 1) // block_size if window and rows else 0
    pad = -rows % ROW_MULTIPLE
    positions = F.pad(positions, (0, pad)).to(q.device)  # padding rows: position 0 of seq 0
    tables = meta.block_tables[F.pad(seq_of_row, (0, pad)).to(q.device)]
    # Every tensor below keeps head_dim innermost and block_size right after the rows.
    query = F.pad(q.float() * scale, (0, 0, 0, 0, 0, pad))
    query = query.view(-1, 1, num_kv_heads, group, head_dim)

    shape = (rows + pad, num_kv_heads, group)
    if features.sinks is None:
        running_max = torch.full(shape, float("-inf"), device=q.device)
        running_sum = torch.zeros(shape, device=q.device)
    else:  # the sink is a logit seen first, whose value is dropped: max = sink, sum = 1
        running_max = features.sinks.view(1, num_kv_heads, group).expand(shape).clone()
        running_sum = torch.ones(shape, device=q.device)
    acc = torch.zeros(*shape, head_dim, device=q.device)
    offsets = torch.arange(block_size, device=q.device)
    for block in range(first_block, last_block + 1):
        ids = tables[:, block]
        key_positions = block * block_size + offsets[None, :]
        visible = key_positions <= positions[:, None]  # [R, block]
        if window:
            visible &= key_positions > positions[:, None] - window
        hidden = ~visible[:, :, None, None]
        active = visible.any(1)[:, None, None]
        keys = k_cache[ids].float()[:, :, :, None]  # [R, block, Hkv, 1, D]
        values = v_cache[ids].float().masked_fill(hidden, 0.0)  # unwritten slots may be NaN
        scores = (query * keys).sum(-1)  # [R, block, Hkv, G]
        if features.softcap:
            scores = torch.tanh(scores / features.softcap) * features.softcap
        scores = scores.masked_fill(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(1))
        new_max = torch.where(active, new_max, 0.0)  # rows seeing none of it: no inf - inf
        correction = torch.exp(running_max - new_max)
        weights = torch.exp(scores - new_max[:, None])
        new_sum = correction * running_sum + weights.sum(1)
        new_acc = correction[..., None] * acc + (weights[..., None] * values[:, :, :, None]).sum(1)
        running_max = torch.where(active, new_max, running_max)
        running_sum = torch.where(active, new_sum, running_sum)
        acc = torch.where(active[..., None], new_acc, acc)
    out = acc[:rows] / running_sum[:rows, ..., None]
    return out.reshape(rows, num_heads, head_dim).to(q.dtype)


def gathered_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    features: AttentionFeatures = NO_FEATURES,
) -> torch.Tensor:
    split = meta.decode_prefill_split()
    group = q.shape[1] // k_cache.shape[2]
    if not split.prefills:  # every row is a decode row, in order: no gather, no scatter
        return _decode_attention(q, k_cache, v_cache, split, scale, features)
    out = torch.empty_like(q)
    if split.decode_rows.numel():
        out[split.decode_rows] = _decode_attention(
            q[split.decode_rows], k_cache, v_cache, split, scale, features
        )
    for seq, start, end in split.prefills:
        context_len = int(meta.context_lens_host[seq])
        blocks = meta.block_tables[seq, : -(-context_len // k_cache.shape[1])]
        keys = k_cache[blocks].flatten(0, 1)[:context_len]  # [S, Hkv, D]
        values = v_cache[blocks].flatten(0, 1)[:context_len]
        out[start:end] = attend_causal(q[start:end], keys, values, scale, group, features)
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    split: DecodePrefillSplit,
    scale: float,
    features: AttentionFeatures,
) -> torch.Tensor:
    """One query token per row, grouped by KV head: q `[B, H, D]` -> `[B, H, D]`."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    keys = k_cache[split.decode_block_tables].flatten(1, 2)  # [B, S, Hkv, D]
    values = v_cache[split.decode_block_tables].flatten(1, 2)
    grouped = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", grouped, keys).float() * scale
    key_positions = torch.arange(keys.shape[1], device=q.device)
    lens = split.decode_context_lens[:, None]
    hidden = key_positions >= lens
    if features.sliding_window:
        hidden |= key_positions <= lens - 1 - features.sliding_window
    probs = _softmax(scores, hidden[:, None, None, :], features).to(values.dtype)
    return torch.einsum("bhgs,bshd->bhgd", probs, values).reshape(rows, num_heads, head_dim)


def _softmax(
    scores: torch.Tensor, hidden: torch.Tensor, features: AttentionFeatures
) -> torch.Tensor:
    """Softmax over the last axis of `scores [..., Hkv, G, S]` (fp32) with the hidden keys
    left out, after the softcap, with each head's sink logit in the denominator."""
    if features.softcap:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    scores = scores.masked_fill(hidden, float("-inf"))
    if features.sinks is None:
        return scores.softmax(dim=-1)
    sinks = features.sinks.view(*scores.shape[-3:-1], 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]


def attend_causal(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    group_size: int,
    features: AttentionFeatures = NO_FEATURES,
) -> torch.Tensor:
    """q `[Tq, H, D]` at the last Tq of S positions, keys/values `[S, Hkv, D]` -> `[Tq, H, D]`.

    Query i sits at position S - Tq + i and sees keys up to and including it (and within
    the window). The tensors go to `scaled_dot_product_attention` as `[1, heads, tokens,
    D]`: with a batch dimension it takes its fused flash kernel on the CPU too (faster than
    the 3-D call for long chunks), and a chunk that is its whole context
    needs no mask (`is_causal`). SDPA has no softcap or sinks: with either, the scores are
    computed here.
    """
    num_queries, context_len = q.shape[0], keys.shape[0]
    mask = None
    plain = not features.softcap and features.sinks is None
    if num_queries != context_len or features.sliding_window or not plain:
        query_pos = torch.arange(context_len - num_queries, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        mask = key_pos <= query_pos[:, None]
        if features.sliding_window:
            mask &= key_pos > query_pos[:, None] - features.sliding_window
    if not plain:
        grouped = q.view(num_queries, keys.shape[1], group_size, q.shape[2])
        scores = torch.einsum("qhgd,shd->qhgs", grouped, keys).float() * scale
        probs = _softmax(scores, ~mask[:, None, None, :], features).to(values.dtype)
        out = torch.einsum("qhgs,shd->qhgd", probs, values)
        return out.reshape(q.shape)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group_size > 1,
    )  # fmt: skip
    return out[0].transpose(0, 1)
