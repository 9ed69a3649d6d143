"""The `cpp` attention backend (`CppAttention`): the C++ paged-attention kernel
(`paged_attention.cpp`), built once per machine and loaded on first use (see
`cpp_extension`), on the CPU.

The extension defines the kernel twice over one implementation: `paged_attention` below
(pybind, one layer's K and V caches) and, with the K/V store, as the ops
`pagedserve::paged_attention` and `pagedserve::store_kv` (`register_kernel_ops`). The
backend runs the ops, eager and compiled alike, so a compiled forward keeps them as single
calls inside one graph (see `kernels.custom_ops`). They take the whole KV tensor `[num_layers, 2,
num_blocks, block_size, Hkv, D]` and a layer index, not one layer's K and V views:
Inductor mishandles an op that mutates two views of one base (the mutation was lost and
attention read wrong values), and one mutated graph input has no such aliasing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.model.attention_metadata import AttentionFeatures, PagedAttentionMetadata
from engine.model.kernels.cpp_extension import CppExtension, KernelUnavailableError

EXTENSION = CppExtension("paged_attention", Path(__file__).with_name("paged_attention.cpp"))
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256, 512)

# Whether the ops have their fakes (`register_kernel_ops`).
_kernel_ops_registered = False

# (q, k_cache, v_cache, block_tables, query_start, context_lens, scale, sliding_window,
# softcap, sinks) -> out, the ten arguments in this order, all positional: see
# `paged_attention`.
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


class CppAttention:
    """The `cpp` backend: the K/V store and the kernel through their registered ops, which
    read only the metadata's tensors and skip a negative slot, so the compiled forward
    runs them too (`compiles`). A row's bits depend only on its query, its position and
    its context (see `paged_attention`)."""

    name = "cpp"
    compiles = True
    captures = False  # a CPU kernel: the decode graphs are CUDA's

    def __init__(self, device: torch.device) -> None:
        register_kernel_ops()

    @staticmethod
    def unavailable_reason(
        device: torch.device, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        """Why the kernel cannot run for these (tries the build if no call has yet)."""
        if device.type != "cpu":
            return f"the C++ kernel runs on the CPU, not on {device}"
        if dtype not in SUPPORTED_DTYPES:
            return f"the C++ kernel takes float32 or bfloat16, not {dtype}"
        if head_size not in SUPPORTED_HEAD_DIMS:
            sizes = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
            return f"the C++ kernel takes head sizes {sizes}, not {head_size}"
        return unavailable_reason()

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
    ) -> None:
        """A negative slot (a padding row of a compiled step) is not written."""
        torch.ops.pagedserve.store_kv(key, value, kv_cache, layer, slots)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: PagedAttentionMetadata,
        scale: float,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        """`paged_attention` over `kv_cache[layer]`: the same kernel, the same bits."""
        return torch.ops.pagedserve.paged_attention(
            q, kv_cache, layer, meta.block_tables, meta.query_start, meta.context_lens, scale,
            features.sliding_window, features.softcap, features.sinks,
        )  # fmt: skip


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


def register_kernel_ops() -> None:
    """Load the extension, which defines the ops `pagedserve::store_kv` and
    `pagedserve::paged_attention`, and give the ops their fakes. Idempotent; raises
    `KernelUnavailableError` where the kernel cannot be built. Call before calling the ops
    or compiling a forward that uses them (`CppAttention` does, once constructed)."""
    global _kernel_ops_registered
    if _kernel_ops_registered:
        return
    EXTENSION.load()
    torch.library.register_fake("pagedserve::store_kv")(_fake_store_kv)
    torch.library.register_fake("pagedserve::paged_attention")(_fake_paged_attention)
    _kernel_ops_registered = True


def _fake_store_kv(*args: object) -> None:
    return None


def _fake_paged_attention(q: torch.Tensor, *args: object) -> torch.Tensor:
    # Contiguous, as the kernel's output, or compiled code would read it with q's strides.
    return q.new_empty(q.shape)
