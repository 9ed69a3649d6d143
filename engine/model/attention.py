"""Paged attention for Hugging Face models, plugged in through transformers' attention interface.

The model runs over one packed batch `[1, num_tokens]`. For every layer this function
writes the step's new K/V into their slots of the paged KV tensor and then attends each
query row over its sequence's blocks, through one of four implementations with one
contract (see `engine.model.torch_attention`): the C++ kernel on the CPU, the blockwise
torch path on a CPU without it, the gathered torch path on CUDA, and the Triton kernels
(opt-in on CUDA: `attention_backend: triton`; they have not run on a GPU in this project
yet). Every implementation takes a layer's `AttentionFeatures` (a sliding window, logit
softcapping, attention sinks); any other argument a model passes that could change the
result is refused by name (`attention_features`), never dropped. K and V of different
head sizes (MLA computed as multi-head attention) are zero-padded to one size in the
cache and the output is cut back to V's. On the CPU a row's bits depend only on its query,
its position and its context, never on the rest of the batch. A step without host-side
lengths (the compiled forward) runs the C++ kernel and the K/V store through their
registered ops (`kernels.custom_ops`).
The causal-mask construction of the model is skipped: transformers builds no mask for an
attention implementation that has no registered mask function.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.config import ConfigError
from engine.errors import UnsupportedModelError
from engine.model.attention_metadata import AttentionFeatures, PagedAttentionMetadata
from engine.model.kernels import custom_ops
from engine.model.kernels.paged_attention import (
    AttentionKernel,
    load_attention_kernel,
    supports,
    unavailable_reason,
)
from engine.model.torch_attention import blockwise_attention, gathered_attention

ATTN_IMPLEMENTATION = "pagedserve"
# Attention through the C++ kernel; a name of its own so both backends can coexist.
ATTN_IMPLEMENTATION_CPP = "pagedserve_cpp"
ATTN_IMPLEMENTATION_TRITON = "pagedserve_triton"


# Arguments transformers' attention modules pass that do not change inference attention.
NEUTRAL_ARGUMENTS = frozenset(
    {"position_ids", "use_cache", "output_router_logits", "cache_position", "output_attentions"}
)


def attention_features(arguments: dict[str, Any]) -> AttentionFeatures:
    """The features of one attention call from the keyword arguments a transformers
    attention module passed. Raises `UnsupportedModelError` naming any argument that is
    set and neither implemented nor neutral (a transformers upgrade may add some)."""
    for name, value in arguments.items():
        if name in NEUTRAL_ARGUMENTS or name in ("sliding_window", "softcap", "s_aux"):
            continue
        if value is None or (name == "is_causal" and value is True):
            continue
        raise UnsupportedModelError(
            f"attention argument `{name}` ({_describe(value)}) is not implemented by pagedserve"
        )
    sinks = arguments.get("s_aux")
    return AttentionFeatures(
        sliding_window=int(arguments.get("sliding_window") or 0),
        softcap=float(arguments.get("softcap") or 0.0),
        sinks=None if sinks is None else sinks.detach().float().contiguous(),
    )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)[:60]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedAttentionMetadata | None = None,
    kernel: AttentionKernel | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query `[1, H, T, Dk]`, key `[1, Hkv, T, Dk]`, value `[1, Hkv, T, Dv]` -> output
    `[1, T, H, Dv]`.

    Attention runs through `kernel` when one is bound and supports the tensors, else in
    torch: blockwise on the CPU, gathered elsewhere.
    """
    features = attention_features(kwargs)
    meta, scale, k_cache, v_cache = _layer_inputs(module, query, scaling, paged_metadata)
    value_dim = value.shape[3]
    query, key, value = _one_head_size(query, key, value)
    if meta.positions_host is None:
        if kernel is None or not supports(query.dtype, query.shape[3], query.device):
            raise RuntimeError(
                "a step without host-side lengths (a compiled forward) needs the C++ kernel"
            )
        out = _registered_ops_attention(module, query, key, value, meta, scale, features)
        return out[..., :value_dim], None
    head_dim = query.shape[3]
    custom_ops.write_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    q = query[0].transpose(0, 1)  # [T, H, D]
    if kernel is not None and supports(q.dtype, head_dim, q.device):
        out = kernel(
            q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.context_lens, scale,
            features.sliding_window, features.softcap, features.sinks,
        )  # fmt: skip
    elif q.device.type == "cpu":
        out = blockwise_attention(q, k_cache, v_cache, meta, scale, features)
    else:
        out = gathered_attention(q, k_cache, v_cache, meta, scale, features)
    return out[..., :value_dim].unsqueeze(0), None


def _one_head_size(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V zero-padded to one head size (a no-op where they share one): zeros add
    nothing to a dot product, and V's padded columns come out zero and are cut off."""
    size = max(key.shape[3], value.shape[3])
    if key.shape[3] < size:
        query = F.pad(query, (0, size - key.shape[3]))
        key = F.pad(key, (0, size - key.shape[3]))
    if value.shape[3] < size:
        value = F.pad(value, (0, size - value.shape[3]))
    return query, key, value


def _registered_ops_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    features: AttentionFeatures,
) -> torch.Tensor:
    """The C++ kernel's path through `custom_ops`, which compiled graphs keep as calls:
    padding rows (negative slots) store nothing; the output is `[1, T, H, D]`."""
    layer = module.layer_idx
    custom_ops.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), meta.kv_cache, layer, meta.slot_mapping
    )
    out = custom_ops.paged_attention(
        query[0].transpose(0, 1),
        meta.kv_cache,
        layer,
        meta.block_tables,
        meta.query_start,
        meta.context_lens,
        scale,
        features.sliding_window,
        features.softcap,
        features.sinks,
    )
    return out.unsqueeze(0)


def triton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """`paged_attention_forward`'s contract through the Triton kernels: the K/V store and
    the attention read only device tensors, so a whole forward can be captured in a graph."""
    from engine.model.kernels import triton_attention

    features = attention_features(kwargs)
    meta, scale, k_cache, v_cache = _layer_inputs(module, query, scaling, paged_metadata)
    value_dim = value.shape[3]
    query, key, value = _one_head_size(query, key, value)
    triton_attention.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    out = triton_attention.paged_attention(
        query[0].transpose(0, 1),
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start,
        meta.context_lens,
        scale,
        meta.max_query_len,
        sliding_window=features.sliding_window,
        softcap=features.softcap,
        sinks=features.sinks,
    )
    return out[..., :value_dim].unsqueeze(0), None


def _layer_inputs(
    module: torch.nn.Module,
    query: torch.Tensor,
    scaling: float | None,
    paged_metadata: PagedAttentionMetadata | None,
) -> tuple[PagedAttentionMetadata, float, torch.Tensor, torch.Tensor]:
    """What every implementation starts from: the step's metadata, the softmax scale (the
    model's, else 1/sqrt(head_dim)) and this layer's K and V caches."""
    if paged_metadata is None:
        raise RuntimeError("pagedserve attention needs the model runner's paged_metadata")
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    k_cache, v_cache = paged_metadata.kv_cache[module.layer_idx]
    return paged_metadata, scale, k_cache, v_cache


def register_paged_attention(
    backend: str = "torch",
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
) -> str:
    """Register the function with transformers (idempotent) and return its name.

    `backend` is the `attention_backend` setting: 'cpp' binds the C++ kernel and raises
    if it cannot be built or `device` is not the CPU; 'auto' binds it on the CPU when it
    builds (a failed build is logged once) and otherwise keeps torch; 'triton' binds the
    Triton kernels and raises unless Triton is importable, the device is CUDA (or the
    CPU under `TRITON_INTERPRET=1`, for tests) and the kernels take `dtype` and
    `block_size`.
    """
    if backend == "triton":
        _check_triton(device, dtype, block_size)
        AttentionInterface.register(ATTN_IMPLEMENTATION_TRITON, triton_attention_forward)
        return ATTN_IMPLEMENTATION_TRITON
    on_cpu = device is None or device.type == "cpu"
    if backend == "cpp" and not on_cpu:
        raise ConfigError(f"attention_backend 'cpp' runs on the CPU, not on {device}")
    kernel = load_attention_kernel() if backend != "torch" and on_cpu else None
    if backend == "cpp" and kernel is None:
        raise ConfigError(
            f"attention_backend 'cpp': the C++ kernel cannot be built here: {unavailable_reason()}"
        )
    if kernel is None:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        return ATTN_IMPLEMENTATION
    custom_ops.register_kernel_ops()  # the compiled forward's store and attention ops
    AttentionInterface.register(
        ATTN_IMPLEMENTATION_CPP, partial(paged_attention_forward, kernel=kernel)
    )
    return ATTN_IMPLEMENTATION_CPP


def _check_triton(device: torch.device | None, dtype: torch.dtype, block_size: int) -> None:
    try:
        from engine.model.kernels import triton_attention
    except ImportError as exc:
        raise ConfigError(
            f"attention_backend 'triton' needs Triton (it ships with CUDA torch): {exc}"
        ) from None
    on_cuda = device is not None and device.type == "cuda"
    if not on_cuda and not triton_attention.interpreted():
        raise ConfigError(
            "attention_backend 'triton' runs on CUDA (on the CPU only under TRITON_INTERPRET=1)"
        )
    if not triton_attention.supports(dtype, block_size):
        raise ConfigError(
            f"attention_backend 'triton' takes fp32, fp16 or bf16 and a power-of-two "
            f"block_size of 16 or more, not {dtype} with block_size {block_size}"
        )
