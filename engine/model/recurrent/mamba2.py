"""Mamba-2 layers (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1): the input projection
into gate, x/B/C and dt, a causal convolution over x/B/C, the selective state space
recurrence with its D skip, a gated RMS norm and the output projection, as transformers'
mixers compute them, with the convolution window and the matrix (`[heads, state size,
head dim]`) kept per sequence. Falcon-H1's multipliers and optional norm are read off the
module."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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
    rows, dtype = x.shape[0], x.dtype
    multiplier = getattr(module, "ssm_in_multiplier", None)
    projected = module.in_proj(x if multiplier is None else x * multiplier)
    mup = getattr(module, "mup_vector", None)
    if mup is not None:
        projected = projected * mup[0, 0]
    gate, xbc, dt = projected.split(
        [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1
    )
    xbc = ops.causal_conv(xbc, module.conv1d, True, module.state_index, step).to(dtype)
    groups = module.n_groups * module.ssm_state_size
    values, b, c = xbc.float().split([module.intermediate_size, groups, groups], dim=-1)
    low, high = module.time_step_limit
    dt = F.softplus(dt.float() + module.dt_bias.float()).clamp(low, high)
    out = ops.ssd_scan(
        values.view(rows, module.num_heads, module.head_dim),
        dt,
        -module.A_log.float().exp(),
        b.view(rows, module.n_groups, -1),
        c.view(rows, module.n_groups, -1),
        module.D.float(),
        module.state_index,
        step,
    ).view(rows, -1)
    if getattr(module, "mamba_rms_norm", True):
        out = module.norm(out, gate)
    else:
        out = out * F.silu(gate.float())
    return module.out_proj(out.to(dtype))[None]


def _state(module: Any) -> tuple[tuple[int, int], tuple[int, ...]]:
    shape = (module.num_heads, module.ssm_state_size, module.head_dim)
    return conv_window(module.conv1d), shape


MIXERS = ("GraniteMoeHybridMambaLayer", "BambaMixer", "NemotronHMamba2Mixer", "FalconH1Mixer")
KIND = RecurrentKind("mamba2", dict.fromkeys(MIXERS, forward), _state)
