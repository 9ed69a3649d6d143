"""sentence-transformers' Dense module: a linear and an activation over the pooled vector
(EmbeddingGemma's two projections), computed in fp32 on one vector at a time, so a text's
embedding does not depend on its batch."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn

from engine.errors import ModelLoadError
from engine.pooling.spec import DenseSpec


def load_dense(spec: DenseSpec) -> nn.Sequential:
    """`activation(linear(x))` from the module's folder (model.safetensors, or
    pytorch_model.bin: `linear.weight` and `linear.bias`)."""
    safetensors, pickled = spec.path / "model.safetensors", spec.path / "pytorch_model.bin"
    if safetensors.is_file():
        weights = load_file(safetensors)
    elif pickled.is_file():
        weights = torch.load(pickled, map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{spec.path}: the Dense module has no model.safetensors")
    if "linear.weight" not in weights:
        raise ModelLoadError(f"{spec.path}: the Dense module has no linear.weight")
    out_features, in_features = weights["linear.weight"].shape
    linear = nn.Linear(in_features, out_features, bias="linear.bias" in weights)
    state = {k.removeprefix("linear."): v.float() for k, v in weights.items()}
    try:
        linear.load_state_dict(state)
    except RuntimeError as exc:
        raise ModelLoadError(f"{spec.path}: the Dense module's weights do not fit: {exc}") from None
    return nn.Sequential(linear, getattr(nn, spec.activation)()).requires_grad_(False)
