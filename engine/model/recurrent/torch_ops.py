"""The recurrent layers' sequence operations in plain torch, sequence by sequence and token
by token: the reference the C++ kernels are tested against, and the path on devices they
do not run on. Each takes a step's packed rows and its `RecurrentStep` (which slot each
sequence reads its state from and leaves it in, and the checkpoints to copy), and
computes in fp32, one token after another, so a row's bits never depend on how its
sequence was split into steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.recurrent.state import RecurrentStep


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer: int,
    step: RecurrentStep,
) -> torch.Tensor:
    """Depthwise causal convolution of the packed rows `x [T, C]` with `weight [K, C]`
    (tap-major, fp32) and `bias [C]`: row t gets bias + sum_k weight[k] * input[t - K + 1 +
    k], each sequence continuing from its window of its last K - 1 inputs,
    `step.states.conv[layer, slot]` `[K - 1, C]`. Returns `[T, C]` fp32, before any
    activation."""
    conv = step.states.conv[layer]
    width = weight.shape[0] - 1
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    kernel = weight.T[:, None, :]  # [C, 1, K] for conv1d
    for seq, first, end, source in _sequences(step):
        window = conv[source] if source >= 0 else conv.new_zeros(conv.shape[1:])
        inputs = torch.cat((window, x[first:end].float()))  # [K - 1 + n, C]
        out[first:end] = F.conv1d(inputs.T[None], kernel, bias, groups=x.shape[1])[0].T
        for row, slot in _checkpoints(step, first, end):
            at = row - first + 1  # inputs[at:at + width] are the width inputs up to row
            conv[slot] = inputs[at : at + width]
        conv[int(step.slots[seq])] = inputs[inputs.shape[0] - width :]
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layer: int,
    step: RecurrentStep,
) -> torch.Tensor:
    """Gated DeltaNet's recurrence over the packed rows: q, k `[T, Hk, Dk]` (normalized,
    q scaled), v `[T, Hv, Dv]`, g (log decay) and beta `[T, Hv]`, all fp32; value head h
    reads key head h // (Hv // Hk). Per token, with S `[Hv, Dk, Dv]` from
    `step.states.ssm[layer]`: S *= exp(g); S += k (beta (v - k^T S))^T; out = q^T S.
    Returns `[T, Hv, Dv]` fp32."""
    ssm = step.states.ssm
    assert ssm is not None
    groups = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    rows = _checkpoint_slots(step)
    for seq, first, end, source in _sequences(step):
        state = ssm[layer, source].clone() if source >= 0 else ssm.new_zeros(ssm.shape[2:])
        for t in range(first, end):
            state *= g[t].exp()[:, None, None]
            delta = (v[t] - (state * k[t][:, :, None]).sum(1)) * beta[t][:, None]
            state += k[t][:, :, None] * delta[:, None, :]
            out[t] = (state * q[t][:, :, None]).sum(1)
            if t in rows:
                ssm[layer, rows[t]] = state
        ssm[layer, int(step.slots[seq])] = state
    return out


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
    """Mamba-2's selective state space recurrence over the packed rows: x `[T, H, P]`, dt
    `[T, H]` (after its bias, softplus and limits), a `[H]` (negative), b, c `[T, G, N]`,
    d `[H]`, all fp32; head h reads group h // (H // G). Per token, with S `[H, N, P]` from
    `step.states.ssm[layer]`: S = exp(dt a) S + b (dt x)^T; out = c^T S + d x. Returns
    `[T, H, P]` fp32."""
    ssm = step.states.ssm
    assert ssm is not None
    groups = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(groups, dim=1), c.repeat_interleave(groups, dim=1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = _checkpoint_slots(step)
    for seq, first, end, source in _sequences(step):
        state = ssm[layer, source].clone() if source >= 0 else ssm.new_zeros(ssm.shape[2:])
        for t in range(first, end):
            state *= (dt[t] * a).exp()[:, None, None]
            state += b[t][:, :, None] * (dt[t][:, None] * x[t])[:, None, :]
            out[t] = (state * c[t][:, :, None]).sum(1) + d[:, None] * x[t]
            if t in rows:
                ssm[layer, rows[t]] = state
        ssm[layer, int(step.slots[seq])] = state
    return out


def _sequences(step: RecurrentStep) -> list[tuple[int, int, int, int]]:
    """(sequence, first row, end row, source slot) of each of the step's sequences."""
    starts = step.query_start.tolist()
    sources = step.sources.tolist()
    return [(b, starts[b], starts[b + 1], sources[b]) for b in range(len(sources))]


def _checkpoint_slots(step: RecurrentStep) -> dict[int, int]:
    """Packed row -> the slot its state is copied to."""
    rows, slots = step.checkpoint_rows.tolist(), step.checkpoint_slots.tolist()
    return {row: slot for row, slot in zip(rows, slots, strict=True) if row >= 0}


def _checkpoints(step: RecurrentStep, first: int, end: int) -> list[tuple[int, int]]:
    """(row, slot) of the checkpoints after rows in `[first, end)`."""
    return [(row, slot) for row, slot in _checkpoint_slots(step).items() if first <= row < end]
