"""Which models pagedserve runs exactly; the rest are refused with one line that names the
model and what it lacks, before any request runs.

Two checks. `check_config_supported` reads the config before a weight loads: no chunked
attention layers, the model class must call transformers' attention interface, the model
must be a decoder, and every module that keeps recurrent state (a depthwise causal
convolution, a state space's `A_log`, a mixer's name) must be of a recurrent kind that
`engine.model.recurrent` implements, found in the model built on the meta device (no
weight allocated). `probe_attention` then runs one token through the loaded model with a
recording attention function: every call must carry only arguments paged attention
implements (`attention.attention_features`), and the calls give the KV cache's layout:
which layers attend (a hybrid's others keep recurrent state, or mix no tokens at all, as
Nemotron-H's MLP blocks), their KV shape (K and V head sizes may differ: the cache takes
the larger) and, where every one slides, the window behind which blocks can be released.
What a transformers model does in its attention call, not what its config promises,
decides.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from accelerate import init_empty_weights
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from engine.errors import UnsupportedModelError
from engine.model.attention import attention_features
from engine.model.kv_cache import KVGroup, KVLayout
from engine.model.recurrent import recurrent_modules

PROBE_IMPLEMENTATION = "pagedserve_probe"
# Module class names of token mixers that keep recurrent state (with the structural signs
# in `_keeps_state`).
STATEFUL_NAMES = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|RWKV|Recurrent|LinearAttention")
IMPLEMENTED_KINDS = "Gated DeltaNet, Mamba-2 and short convolution"
# Modules of sparse attention: DeepSeek V3.2's indexer, V4's compressors.
SPARSE_NAMES = re.compile(r"Indexer$|Compressor$")


def check_config_supported(config: PretrainedConfig) -> None:
    """Refuse, before the weights load, a model whose config shows paged attention and the
    recurrent layer kinds cannot run it exactly. Raises `UnsupportedModelError`."""
    text = config.get_text_config()
    name = _name(config)
    layer_types = set(getattr(text, "layer_types", None) or ())
    if "chunked_attention" in layer_types or getattr(text, "attention_chunk_size", None):
        raise UnsupportedModelError(
            f"{name} has chunked local attention layers; pagedserve implements full and "
            "sliding-window attention only"
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; pagedserve serves decoders"
        )
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        return
    # A hybrid's classes do not claim the flag, though their attention modules call the
    # interface; `probe_attention` checks every layer's call.
    hybrid = _check_recurrent_layers(config, name)
    if not hybrid and not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not use transformers' attention interface; pagedserve cannot page it"
        )


def _check_recurrent_layers(config: PretrainedConfig, name: str) -> bool:
    """Whether the model, built on the meta device, has recurrent layers; refuse one with
    a stateful token mixer of no implemented recurrent kind (the innermost module that
    looks stateful, so the mixer rather than the layer or model holding it)."""
    with init_empty_weights(include_buffers=True):
        skeleton = AutoModelForCausalLM.from_config(config)
    for module in skeleton.modules():
        if SPARSE_NAMES.search(type(module).__name__):
            raise UnsupportedModelError(
                f"{name} has sparse attention ({type(module).__name__} selects or compresses "
                "the keys a query attends to); pagedserve implements full and sliding-window "
                "attention"
            )
    implemented = {type(module) for module in recurrent_modules(skeleton).values()}
    marked = [
        (path, module)
        for path, module in skeleton.named_modules()
        if type(module) in implemented or _keeps_state(module)
    ]
    paths = [path for path, _ in marked]
    for path, module in marked:
        outer = any(not path or other.startswith(f"{path}.") for other in paths if other != path)
        if type(module) not in implemented and not outer:
            raise UnsupportedModelError(
                f"{name} has {type(module).__name__} layers, which keep recurrent state of a "
                f"kind pagedserve does not implement (it runs {IMPLEMENTED_KINDS} layers)"
            )
    return bool(implemented)


def _keeps_state(module: torch.nn.Module) -> bool:
    """Whether `module` looks like a token mixer with recurrent state: a depthwise
    convolution or a state space's `A_log` of its own, or a mixer's name and projections."""
    if "A_log" in module._parameters:
        return True
    children = list(module.children())
    if any(isinstance(c, torch.nn.Conv1d) and c.groups == c.in_channels > 1 for c in children):
        return True
    named = bool(STATEFUL_NAMES.search(type(module).__name__))
    return named and any(isinstance(child, torch.nn.Linear) for child in children)


@dataclass
class _Calls:
    """Per layer index: (KV heads, K head size, V head size) of its attention call, its
    sliding window (0: none), and the keys it was given (a layer handed another's keys
    shares that layer's KV; holding them all keeps their memory from being reused, so two
    layers' keys share an address only when they are one tensor)."""

    shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    windows: dict[int, int] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)


def probe_attention(model: PreTrainedModel) -> KVLayout:
    """Run one token through `model` with a recording attention function and return the
    KV layout its calls show. Raises `UnsupportedModelError` where a call passes an
    argument paged attention does not implement (naming the model and the argument), a
    layer with attention never calls the attention interface, no layer attends, or the
    attending layers differ in KV shape."""
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
        calls.keys[int(layer)] = key
        batch, heads, tokens = query.shape[:3]
        return value.new_zeros(batch, tokens, heads, value.shape[3]), None

    AttentionInterface.register(PROBE_IMPLEMENTATION, record)
    serving = model.config._attn_implementation
    model.config._attn_implementation = PROBE_IMPLEMENTATION
    device = next(model.parameters()).device
    # The recurrent layers' own forwards run here, for one token, before pagedserve's
    # replace them: transformers' note that they fall back to slow torch code is not news.
    kernels_log = logging.getLogger("transformers.integrations.hub_kernels")
    level = kernels_log.level
    kernels_log.setLevel(logging.ERROR)
    try:
        with torch.inference_mode():
            token = torch.zeros(1, 1, dtype=torch.long, device=device)
            model(input_ids=token, position_ids=token, use_cache=False)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None
    finally:
        model.config._attn_implementation = serving
        kernels_log.setLevel(level)
    return _layout(name, model, calls)


def _layout(name: str, model: PreTrainedModel, calls: _Calls) -> KVLayout:
    """The KV layout of the layers that attend. A layer that made no attention call must
    keep recurrent state (`engine.model.recurrent`) or hold no attention module at all (a
    block of an MLP only)."""
    num_layers = model.config.get_text_config().num_hidden_layers
    recurrent = recurrent_modules(model)
    attention = {
        int(module.layer_idx)
        for module in model.modules()
        if type(module).__name__.endswith("Attention")
        and isinstance(getattr(module, "layer_idx", None), int)
    }
    for layer in sorted(set(range(num_layers)) - set(calls.shapes)):
        if layer in attention and layer not in recurrent:
            raise UnsupportedModelError(
                f"{name}: layer {layer} attends without transformers' attention interface"
            )
    if not calls.shapes:
        raise UnsupportedModelError(
            f"{name}: no layer attends; pagedserve serves models with attention layers"
        )
    windows = calls.windows.values()
    window = max(windows) if all(windows) else 0
    return KVLayout(*_groups(calls), sliding_window=window)


def _groups(calls: _Calls) -> tuple[tuple[KVGroup, ...], dict[int, tuple[int, int]]]:
    """The K/V shape groups of the attending layers (K and V of one layer padded to one
    head size), in order of first appearance, and each layer's place: a layer handed the
    keys of an earlier layer reads that layer's place."""
    shapes: list[tuple[int, int]] = []  # (KV heads, head size) per group
    counts: list[int] = []
    places: dict[int, tuple[int, int]] = {}
    owners: dict[int, int] = {}  # key address -> the layer that made those keys
    for layer in sorted(calls.shapes):
        owner = owners.setdefault(calls.keys[layer].data_ptr(), layer)
        if owner != layer:
            places[layer] = places[owner]
            continue
        kv_heads, key_size, value_size = calls.shapes[layer]
        shape = (kv_heads, max(key_size, value_size))
        if shape not in shapes:
            shapes.append(shape)
            counts.append(0)
        group = shapes.index(shape)
        places[layer] = (group, counts[group])
        counts[group] += 1
    groups = tuple(KVGroup(n, h, d) for n, (h, d) in zip(counts, shapes, strict=True))
    return groups, places


def _name(config: PretrainedConfig) -> str:
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", "?")
    return f"{architectures[0]} ({model_type})" if architectures else f"model type {model_type}"
