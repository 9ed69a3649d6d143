"""Attention text by text over packed rows, for models whose own forward runs as a pooling
model's: decoders and ModernBERT.

A batch's texts run through the model's own forward as one packed sequence `[1, tokens]`
(each text's positions from 0, padding rows after the last text), and transformers hands
each layer's attention to `text_attention_forward` (registered under `TEXT_ATTENTION`):
every text attends over its own rows only (causally in a decoder's layer, both ways in an
encoder's), through the CPU's fused SDPA, or the model's own softmax where a layer caps
its logits, and padding rows come out zero. Every other operation of these models works
row by row, so a text's hidden states have the same bits alone and in any batch. No mask
is built: transformers builds none for an attention implementation with no mask function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from engine.errors import UnsupportedModelError
from engine.model.attention import attention_features

TEXT_ATTENTION = "pagedserve_texts"


def text_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    text_lengths: list[int],
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query `[1, H, T, D]`, key and value `[1, Hkv, T, D]` -> `[1, T, H, D]`: the rows of
    each text (`text_lengths`, in order from row 0) attending over its own rows, causally
    unless the module is not causal, within the layer's sliding window if it has one, its
    logits capped if the layer caps them; rows after the texts are zeros."""
    features = attention_features(kwargs)
    if features.sinks is not None:
        raise UnsupportedModelError("attention sinks are not packed")
    causal = getattr(module, "is_causal", True)
    out = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])
    start = 0
    for n in text_lengths:
        rows = slice(start, start + n)
        q, k, v = query[:, :, rows], key[:, :, rows], value[:, :, rows]
        mask = _window_mask(n, features.sliding_window, causal)
        if features.softcap:
            text = _capped_attention(q, k, v, mask, causal, scaling, features.softcap)
        else:
            text = F.scaled_dot_product_attention(
                q, k, v, mask, is_causal=causal and mask is None, scale=scaling, enable_gqa=True
            )
        out[rows] = text[0].transpose(0, 1)
        start += n
    return out[None], None


def _window_mask(n: int, window: int, causal: bool) -> torch.Tensor | None:
    """Which of a text's n rows each row attends to within a sliding window of `window`
    rows (those less than `window` rows away: before it alone where causal); None where
    the window holds the whole text."""
    if not window or n <= window:
        return None
    i = torch.arange(n)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window) if causal else distance.abs() < window


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """One text's attention with its logits capped (`softcap * tanh(logits / softcap)`),
    in the order of transformers' eager attention: `[1, H, n, D]`."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.tanh(q @ k.transpose(2, 3) * scale / softcap) * softcap
    n = q.shape[2]
    if mask is None and causal:
        mask = torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype) @ v


AttentionInterface.register(TEXT_ATTENTION, text_attention_forward)


def attend_text_by_text(model: PreTrainedModel) -> None:
    """Make `model` attend through `text_attention_forward`: its forward then takes
    `text_lengths` (the texts' row counts) beside packed `input_ids` and `position_ids`."""
    model.config._attn_implementation = TEXT_ATTENTION
