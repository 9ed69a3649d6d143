"""Which models pagedserve runs exactly; the rest are refused with one line that names the
model and what it lacks, before any request runs.

Two checks. `check_config_supported` reads the config before a weight loads: every layer
must be an attention layer (full or sliding; no recurrent, state-space, linear-attention,
convolution or chunked layers), the model class must call transformers' attention
interface, and the model must be a decoder. `probe_attention` then runs one token through the loaded
model with a recording attention function: every layer's call must carry only arguments
paged attention implements (`attention.attention_features`), and the calls give the KV
cache's layout (K and V head sizes may differ: the cache takes the larger) and, where every
layer slides, the window behind which blocks can be released. What a
transformers model does in its attention call, not what its config promises, decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from engine.errors import UnsupportedModelError
from engine.model.attention import attention_features
from engine.model.kv_cache import KVLayout

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Config fields that only models with recurrent (state-space) layers have.
RECURRENT_FIELD_PREFIXES = ("mamba_", "ssm_", "linear_conv", "conv_L_cache", "block_types")
PROBE_IMPLEMENTATION = "pagedserve_probe"


def check_config_supported(config: PretrainedConfig) -> None:
    """Refuse, before the weights load, a model whose config shows paged attention cannot
    run it exactly. Raises `UnsupportedModelError`."""
    text = config.get_text_config()
    name = _name(config)
    layer_types = set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if "chunked_attention" in layer_types or getattr(text, "attention_chunk_size", None):
        raise UnsupportedModelError(
            f"{name} has chunked local attention layers; pagedserve implements full and "
            "sliding-window attention only"
        )
    recurrent = sorted(k for k in text.to_dict() if k.startswith(RECURRENT_FIELD_PREFIXES))
    if layer_types or recurrent:
        kind = ", ".join(sorted(layer_types)) if layer_types else f"state-space ({recurrent[0]})"
        raise UnsupportedModelError(
            f"{name} has {kind} layers, which keep recurrent state; pagedserve pages the KV "
            "of full and sliding-window attention layers and keeps no recurrent state"
        )
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not use transformers' attention interface; pagedserve cannot page it"
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; pagedserve serves decoders"
        )


@dataclass
class _Calls:
    """Per layer index: (KV heads, K head size, V head size) of its attention call, and
    its sliding window (0: none)."""

    shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    windows: dict[int, int] = field(default_factory=dict)


def probe_attention(model: PreTrainedModel) -> KVLayout:
    """Run one token through `model` with a recording attention function and return the
    KV layout its calls show. Raises `UnsupportedModelError` where a call passes an
    argument paged attention does not implement (naming the model and the argument), a
    layer never calls the attention interface, or the layers differ in KV shape."""
    name = _name(model.config)
    calls = _Calls()

    def record(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        features = attention_features(kwargs)
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise UnsupportedModelError("its attention modules carry no layer_idx")
        calls.shapes[int(layer)] = (key.shape[1], key.shape[3], value.shape[3])
        calls.windows[int(layer)] = features.sliding_window
        batch, heads, tokens = query.shape[:3]
        return value.new_zeros(batch, tokens, heads, value.shape[3]), None

    AttentionInterface.register(PROBE_IMPLEMENTATION, record)
    serving = model.config._attn_implementation
    model.config._attn_implementation = PROBE_IMPLEMENTATION
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            token = torch.zeros(1, 1, dtype=torch.long, device=device)
            model(input_ids=token, position_ids=token, use_cache=False)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None
    finally:
        model.config._attn_implementation = serving
    return _layout(name, model.config.get_text_config(), calls)


def _layout(name: str, text: PretrainedConfig, calls: _Calls) -> KVLayout:
    num_layers = text.num_hidden_layers
    missing = sorted(set(range(num_layers)) - set(calls.shapes))
    if missing:
        raise UnsupportedModelError(
            f"{name}: layer {missing[0]} does not call transformers' attention interface "
            "(it keeps state pagedserve does not page)"
        )
    shapes = set(calls.shapes.values())
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"{name}: its layers differ in KV heads or head size ({sorted(shapes)}); "
            "pagedserve's KV cache has one shape for all layers"
        )
    kv_heads, key_size, value_size = shapes.pop()
    windows = calls.windows.values()
    window = max(windows) if all(windows) else 0
    return KVLayout(num_layers, kv_heads, max(key_size, value_size), window)


def _name(config: PretrainedConfig) -> str:
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", "?")
    return f"{architectures[0]} ({model_type})" if architectures else f"model type {model_type}"
