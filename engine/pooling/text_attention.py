"""Attention text by text over packed rows, for decoders run as pooling models.

A batch's texts run through the model's own forward as one packed sequence `[1, tokens]`
(each text's positions from 0, padding rows after the last text), and transformers hands
each layer's attention to `text_attention_forward` (registered under `TEXT_ATTENTION`):
every text attends causally over its own rows only, through the CPU's fused SDPA, and
padding rows come out zero. Every other operation of a decoder works row by row, so a
text's hidden states have the same bits alone and in any batch. No mask is built:
transformers builds none for an attention implementation with no mask function.
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
    each text (`text_lengths`, in order from row 0) attending causally over its own rows,
    within the layer's sliding window if it has one; rows after the texts are zeros."""
    features = attention_features(kwargs)
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError("a decoder's bidirectional attention is not packed")
    if features.softcap or features.sinks is not None:
        raise UnsupportedModelError("logit softcapping and attention sinks are not packed")
    out = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])
    start = 0
    for n in text_lengths:
        rows = slice(start, start + n)
        q, k, v = query[:, :, rows], key[:, :, rows], value[:, :, rows]
        mask = _window_mask(n, features.sliding_window)
        text = F.scaled_dot_product_attention(
            q, k, v, mask, is_causal=mask is None, scale=scaling, enable_gqa=True
        )
        out[rows] = text[0].transpose(0, 1)
        start += n
    return out[None], None


def _window_mask(n: int, window: int) -> torch.Tensor | None:
    """Which of a text's n rows each row attends to within a sliding window of `window`
    rows (itself and the window - 1 before it); None where the causal mask alone does."""
    if not window or n <= window:
        return None
    i = torch.arange(n)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)


AttentionInterface.register(TEXT_ATTENTION, text_attention_forward)


def attend_text_by_text(model: PreTrainedModel) -> None:
    """Make `model` attend through `text_attention_forward`: its forward then takes
    `text_lengths` (the texts' row counts) beside packed `input_ids` and `position_ids`."""
    model.config._attn_implementation = TEXT_ATTENTION
