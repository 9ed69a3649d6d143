"""The C++ paged-attention kernel (`paged_attention.cpp`), built once per machine and
loaded on first use (see `cpp_extension`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.model.kernels.cpp_extension import CppExtension, KernelUnavailableError

EXTENSION = CppExtension("paged_attention", Path(__file__).with_name("paged_attention.cpp"))
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)

# (q, k_cache, v_cache, block_tables, query_start, context_lens, scale, sliding_window,
# softcap, sinks) -> out, the ten arguments in this order, all positional: see
# `paged_attention`; the torch implementations in engine.model.attention share it.
AttentionKernel = Callable[..., torch.Tensor]


def load_attention_kernel() -> AttentionKernel | None:
    """The kernel (see `paged_attention`), or None if it cannot be built here.

    Thread-safe. A failure is logged once, as a warning, when the build fails.
    """
    try:
        return EXTENSION.load().paged_attention
    except KernelUnavailableError:
        return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built or loaded here, or None if it can (tries the build
    if no call has yet): for messages that say why attention stays on torch."""
    return EXTENSION.unavailable_reason()


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the kernel computes attention for tensors of this kind."""
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a paged KV cache, on the CPU, without gathering K/V.

    q `[T, H, D]` packs the step's query rows sequence by sequence; k_cache, v_cache
    `[num_blocks, block_size, Hkv, D]`, contiguous, of q's dtype (see `supports`), with H a
    multiple of Hkv; block_tables `[B, max_blocks]` (int32 or int64) lists each sequence's
    blocks in order, and entries past its last used block are never read; query_start
    `[B + 1]` gives sequence b the rows `[query_start[b], query_start[b + 1])`, the last
    rows of its context of context_lens[b] tokens, each in `[1, max_blocks * block_size]`.
    Returns `[T, H, D]` in q's dtype: for a row at position p and head h,
    softmax(scale * q . K^T) V over positions 0..p of KV head h // (H // Hkv), in fp32.

    Optional features, off at their defaults:
    - `sliding_window` W >= 1: the row sees positions p - W < t <= p only (0: no window).
      Blocks wholly before the first row's window are never read, so their table entries
      may hold anything.
    - `softcap` c > 0: each score s = scale * q . k becomes c * tanh(s / c) before the
      softmax (Gemma 2's logit softcapping; 0: none).
    - `sinks`, a float32 CPU tensor `[H]`: head h's softmax also runs over one logit
      sinks[h] whose probability is dropped, i.e. exp(sinks[h] - max) joins the
      denominator only (gpt-oss's `s_aux`; None: none).

    A row's bits depend only on its query, its position and its context's K/V (see the
    source's "Invariance"), with or without the features. Raises `KernelUnavailableError`
    if the kernel cannot be built and `RuntimeError` on inputs that break these
    invariants (a negative window or softcap, sinks of another shape, dtype or device).
    """
    return EXTENSION.load().paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        context_lens,
        scale,
        sliding_window,
        softcap,
        sinks,
    )
