"""Paged attention for Hugging Face models, plugged in through transformers' attention interface.

The model runs over one packed batch `[1, num_tokens]`. For every layer this function
writes the step's new K/V into their slots of the paged KV tensor and then attends,
per sequence, over that sequence's blocks: decode rows together in one batched
computation, prefill chunks one by one (causal within the chunk, plus everything cached
before it). The causal-mask construction of the model is skipped: transformers builds no
mask for an attention implementation that has no registered mask function.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from engine.config import ConfigError
from engine.errors import UnsupportedModelError
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.kernels.decode_attention import DecodeKernel, load_decode_kernel, supports

ATTN_IMPLEMENTATION = "pagedserve"
# Decode rows through the C++ kernel; a name of its own so both backends can coexist.
ATTN_IMPLEMENTATION_CPP = "pagedserve_cpp"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedAttentionMetadata | None = None,
    decode_kernel: DecodeKernel | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query `[1, H, T, D]`, key/value `[1, Hkv, T, D]` -> output `[1, T, H, D]`.

    Decode rows go through `decode_kernel` when one is bound and supports the tensors.
    """
    if paged_metadata is None:
        raise RuntimeError("pagedserve attention needs the model runner's paged_metadata")
    meta = paged_metadata
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = key.shape[1]
    scale = scaling if scaling is not None else head_dim**-0.5

    k_cache, v_cache = meta.kv_cache[module.layer_idx]
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    k_slots.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_slots.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, H, D]
    if not meta.prefills:  # every token is a decode row, in order: no gather, no scatter
        return _decode_rows(q, k_cache, v_cache, meta, scale, decode_kernel).unsqueeze(0), None
    out = torch.empty_like(q)
    if meta.decode_token_index.numel():
        out[meta.decode_token_index] = _decode_rows(
            q[meta.decode_token_index], k_cache, v_cache, meta, scale, decode_kernel
        )
    for chunk in meta.prefills:
        out[chunk.token_start : chunk.token_end] = _prefill_attention(
            q[chunk.token_start : chunk.token_end], k_cache, v_cache, chunk.block_ids,
            chunk.context_len, scale, num_heads // num_kv_heads,
        )  # fmt: skip
    return out.unsqueeze(0), None


def _decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    decode_kernel: DecodeKernel | None,
) -> torch.Tensor:
    """The decode rows' queries `[B, H, D]` -> `[B, H, D]`, through the kernel when bound."""
    if decode_kernel is not None and supports(q.dtype, q.shape[-1], q.device):
        return decode_kernel(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    return _decode_attention(q, k_cache, v_cache, meta, scale)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per row, grouped by KV head: q `[B, H, D]` -> `[B, H, D]`."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    keys = k_cache[meta.decode_block_tables].flatten(1, 2)  # [B, S, Hkv, D]
    values = v_cache[meta.decode_block_tables].flatten(1, 2)
    grouped = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", grouped, keys).float() * scale
    padding = torch.arange(keys.shape[1], device=q.device) >= meta.decode_context_lens[:, None]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.einsum("bhgs,bshd->bhgd", probs, values).reshape(rows, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    scale: float,
    group_size: int,
) -> torch.Tensor:
    """A chunk of `Tq` query tokens at the end of a `context_len` context: `[Tq, H, D]`."""
    keys = k_cache[block_ids].flatten(0, 1)[:context_len]  # [S, Hkv, D]
    values = v_cache[block_ids].flatten(0, 1)[:context_len]
    return _attend_causal(q, keys, values, scale, group_size)


def _attend_causal(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    group_size: int,
) -> torch.Tensor:
    """q `[Tq, H, D]` at the last Tq of S positions, keys/values `[S, Hkv, D]` -> `[Tq, H, D]`.

    Query i sits at position S - Tq + i and sees keys up to and including it. The tensors
    go to `scaled_dot_product_attention` as `[1, heads, tokens, D]`: with a batch dimension
    it takes its fused flash kernel on the CPU too (3-4x the 3-D call's speed for chunks of
    256+ tokens), and a chunk that is its whole context needs no mask (`is_causal`).
    """
    num_queries, context_len = q.shape[0], keys.shape[0]
    mask = None
    if num_queries != context_len:
        query_pos = torch.arange(context_len - num_queries, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group_size > 1,
    )  # fmt: skip
    return out[0].transpose(0, 1)


def register_paged_attention(backend: str = "torch", device: torch.device | None = None) -> str:
    """Register the function with transformers (idempotent) and return its name.

    `backend` is the `attention_backend` setting: 'cpp' binds the C++ decode kernel and
    raises if it cannot be built or `device` is not the CPU; 'auto' binds it on the CPU
    when it builds (a failed build is logged once) and otherwise keeps torch.
    """
    on_cpu = device is None or device.type == "cpu"
    if backend == "cpp" and not on_cpu:
        raise ConfigError(f"attention_backend 'cpp' runs on the CPU, not on {device}")
    kernel = load_decode_kernel() if backend != "torch" and on_cpu else None
    if backend == "cpp" and kernel is None:
        raise ConfigError("attention_backend 'cpp': the C++ decode kernel did not build (see log)")
    if kernel is None:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        return ATTN_IMPLEMENTATION
    AttentionInterface.register(
        ATTN_IMPLEMENTATION_CPP, partial(paged_attention_forward, decode_kernel=kernel)
    )
    return ATTN_IMPLEMENTATION_CPP


def check_model_supported(model: PreTrainedModel) -> None:
    """Refuse models that paged attention cannot run exactly, with the reason."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not use transformers' attention interface; pagedserve cannot page it"
        )
    config = model.config.get_text_config()
    if config.is_encoder_decoder:
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; pagedserve serves decoders"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"{name} has {sorted(layer_types)} layers; pagedserve supports full attention only"
        )
