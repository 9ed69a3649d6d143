"""The recurrent layers' sequence operations, each run by the C++ kernel where the step
asks for it (`RecurrentStep.use_kernel`, the CPU's path, registered ops that the compiled
forward keeps as calls) and by the torch reference (`torch_ops`) elsewhere; both compute
every token in turn in fp32, so a row's bits do not depend on how its sequence was split
into steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.recurrent import torch_ops
from engine.model.recurrent.state import RecurrentStep


def causal_conv(
    x: torch.Tensor, conv: torch.nn.Conv1d, silu: bool, layer: int, step: RecurrentStep
) -> torch.Tensor:
    """`conv` (depthwise, causal) over the packed rows `x [T, C]` from each sequence's
    window of earlier inputs (see `torch_ops.causal_conv`), then SiLU where `silu`; `[T, C]`
    fp32."""
    weight = conv.weight[:, 0].float().T.contiguous()  # [K, C]
    bias = None if conv.bias is None else conv.bias.float()
    if step.use_kernel:
        out = torch.ops.pagedserve.causal_conv(
            x, weight, bias, step.states.conv, layer, *_slots(step)
        )
    else:
        out = torch_ops.causal_conv(x, weight, bias, layer, step)
    return F.silu(out) if silu else out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layer: int,
    step: RecurrentStep,
) -> torch.Tensor:
    """Gated DeltaNet's recurrence (see `torch_ops.gated_delta_rule`); `[T, Hv, Dv]` fp32."""
    if step.use_kernel:
        assert step.states.ssm is not None
        return torch.ops.pagedserve.gated_delta_rule(
            q, k, v, g, beta, step.states.ssm, layer, *_slots(step)
        )
    return torch_ops.gated_delta_rule(q, k, v, g, beta, layer, step)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    layer: int,
    step: RecurrentStep,
) -> torch.Tensor:
    """Mamba-2's recurrence (see `torch_ops.ssd_scan`); `[T, H, P]` fp32."""
    if step.use_kernel:
        assert step.states.ssm is not None
        return torch.ops.pagedserve.ssd_scan(
            x, dt, a, b, c, d, step.states.ssm, layer, *_slots(step)
        )
    return torch_ops.ssd_scan(x, dt, a, b, c, d, layer, step)


def _slots(step: RecurrentStep) -> tuple[torch.Tensor, ...]:
    return (
        step.query_start,
        step.slots,
        step.sources,
        step.checkpoint_rows,
        step.checkpoint_slots,
    )
