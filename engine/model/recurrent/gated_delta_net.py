"""Gated DeltaNet layers (Qwen3.5 and Qwen3.5-MoE, Qwen3-Next, OLMo hybrid): projections,
a causal convolution over q, k and v, the gated delta rule, a gated RMS norm and the
output projection, as each model's transformers module computes them, with the
convolution window and the `[value heads, key dim, value dim]` matrix kept per sequence.
The models differ only in how their projections give q, k, v, the gate z and the inputs
of beta and the decay (`PROJECTIONS`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.model.recurrent import ops
from engine.model.recurrent.kind import RecurrentKind, conv_window, recurrent_step

Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _qwen3_5(module: Any, x: torch.Tensor) -> Projected:
    return module.in_proj_qkv(x), module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)


def _qwen3_next(module: Any, x: torch.Tensor) -> Projected:
    q, k, v, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None])
    )
    mixed = torch.cat([part.reshape(x.shape[0], -1) for part in (q, k, v)], dim=-1)
    return mixed, z[0], b[0], a[0]


def _olmo_hybrid(module: Any, x: torch.Tensor) -> Projected:
    mixed = torch.cat((module.q_proj(x), module.k_proj(x), module.v_proj(x)), dim=-1)
    return mixed, module.g_proj(x), module.b_proj(x), module.a_proj(x)


# Module class -> (mixed q/k/v before the convolution, gate z, beta's and the decay's
# inputs) of one step's rows `x [T, hidden]`.
PROJECTIONS = {
    "Qwen3_5GatedDeltaNet": _qwen3_5,
    "Qwen3_5MoeGatedDeltaNet": _qwen3_5,
    "Qwen3NextGatedDeltaNet": _qwen3_next,
    "OlmoHybridGatedDeltaNet": _olmo_hybrid,
}


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
    mixed, z, b, a = PROJECTIONS[type(module).__name__](module, x)
    mixed = ops.causal_conv(mixed, module.conv1d, True, module.state_index, step).to(dtype)
    q, k, v = mixed.float().split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = _l2norm(q.view(rows, -1, module.head_k_dim)) * module.head_k_dim**-0.5
    k = _l2norm(k.view(rows, -1, module.head_k_dim))
    beta = b.sigmoid()
    if getattr(module, "allow_neg_eigval", False):
        beta = beta * 2.0
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    out = ops.gated_delta_rule(
        q, k, v.view(rows, -1, module.head_v_dim), g, beta.float(), module.state_index, step
    ).to(dtype)
    norm = module.o_norm if hasattr(module, "o_norm") else module.norm
    out = norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    projection = module.o_proj if hasattr(module, "o_proj") else module.out_proj
    return projection(out.reshape(rows, -1))[None]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """As transformers' (and flash-linear-attention's) `l2norm`, in fp32."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _state(module: Any) -> tuple[tuple[int, int], tuple[int, ...]]:
    return conv_window(module.conv1d), (module.num_v_heads, module.head_k_dim, module.head_v_dim)


KIND = RecurrentKind("gated_delta_net", dict.fromkeys(PROJECTIONS, forward), _state)
