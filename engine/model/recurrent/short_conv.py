"""Short convolution layers (LFM2, LFM2-MoE): B, C and x from one projection, a causal
convolution of B * x, gated by C, and the output projection, with the convolution's
window kept per sequence (no recurrent matrix)."""

from __future__ import annotations

from typing import Any

import torch

from engine.model.recurrent import ops
from engine.model.recurrent.kind import RecurrentKind, conv_window, recurrent_step


def forward(
    module: Any,
    hidden_states: torch.Tensor,
    cache: object = None,
    attention_mask: object = None,
    **kwargs: Any,
) -> torch.Tensor:
    step = recurrent_step(module, kwargs)
    x = hidden_states[0]
    b, c, values = module.in_proj(x).chunk(3, dim=-1)
    out = ops.causal_conv(b * values, module.conv, False, module.state_index, step)
    return module.out_proj(c * out.to(x.dtype))[None]


def _state(module: Any) -> tuple[tuple[int, int], None]:
    return conv_window(module.conv), None


MODULES = ("Lfm2ShortConv", "Lfm2MoeShortConv")
KIND = RecurrentKind("short_conv", dict.fromkeys(MODULES, forward), _state)
