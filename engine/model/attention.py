"""Paged attention for Hugging Face models, plugged in through transformers' attention interface.

The model runs over one packed batch `[1, num_tokens]`. For every layer
`paged_attention_forward` writes the step's new K/V into their slots of the paged KV
tensor and attends each query row over its sequence's blocks through the one
`AttentionBackend` the engine bound at start-up (`bind_attention`; the backends and how
one is chosen: `engine.model.attention_backend`). What every backend shares is done here:
the layer's `AttentionFeatures` (a sliding window, logit softcapping, attention sinks; any
other argument a model passes that could change the result is refused by name,
`attention_features`, never dropped), the softmax scale, and one head size: K and V of
different head sizes (MLA computed as multi-head attention) are zero-padded to one size in
the cache and the output is cut back to V's.
The causal-mask construction of the model is skipped: transformers builds no mask for an
attention implementation that has no registered mask function.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from engine.errors import UnsupportedModelError
from engine.model.attention_backend import AttentionBackend
from engine.model.attention_metadata import AttentionFeatures, PagedAttentionMetadata

# The prefix of the names the bound functions are registered under with transformers.
ATTN_IMPLEMENTATION = "pagedserve"


# Arguments transformers' attention modules pass that do not change inference attention.
NEUTRAL_ARGUMENTS = frozenset(
    {
        "position_ids",
        "use_cache",
        "output_router_logits",
        "cache_position",
        "output_attentions",
        "deterministic",  # flash attention's backward pass (ModernBERT passes it)
    }
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
    *,
    backend: AttentionBackend,
    places: dict[int, tuple[int, int]],
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query `[1, H, T, Dk]`, key `[1, Hkv, T, Dk]`, value `[1, Hkv, T, Dv]` -> output
    `[1, T, H, Dv]`, through `backend` (bound by `bind_attention`) with the model
    runner's `paged_metadata`, the layer's K/V at its place `places[module.layer_idx]`
    (a group's KV tensor, an index in it: `KVLayout.layers`); the softmax scale is the
    model's, else 1/sqrt(Dk)."""
    features = attention_features(kwargs)
    if paged_metadata is None:
        raise RuntimeError("pagedserve attention needs the model runner's paged_metadata")
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    value_dim = value.shape[3]
    query, key, value = _one_head_size(query, key, value)
    group, layer = places[module.layer_idx]
    kv_cache = paged_metadata.kv_caches[group]
    backend.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), kv_cache, layer,
        paged_metadata.slot_mapping,
    )  # fmt: skip
    out = backend.attend(query[0].transpose(0, 1), kv_cache, layer, paged_metadata, scale, features)
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


def bind_attention(
    model: PreTrainedModel, backend: AttentionBackend, places: dict[int, tuple[int, int]]
) -> str:
    """Make `model` attend through `backend`, each layer's K/V at its place in `places`
    (`KVLayout.layers`), and return the name it is registered under with transformers:
    one name per backend, device and layer map, so engines on different backends or
    models can share a process (the registry of attention functions is global)."""
    device = next(model.parameters()).device
    name = f"{ATTN_IMPLEMENTATION}_{backend.name}_{device.type}"
    if places != {layer: (0, layer) for layer in range(len(places))}:
        name += "_" + "-".join(f"{layer}.{g}.{i}" for layer, (g, i) in sorted(places.items()))
    bound = partial(paged_attention_forward, backend=backend, places=places)
    AttentionInterface.register(name, bound)
    model.config._attn_implementation = name
    return name
