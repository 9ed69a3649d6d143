"""The recurrent layers of hybrid models: each kind (a file of this folder) replaces the
forward of transformers' modules of that kind with one that runs the step's packed
sequences from their state slots (`RecurrentStep`), so the attention layers keep their
paged KV and the recurrent layers a fixed-size state per sequence.

A new kind is a file with a `KIND` (`kind.RecurrentKind`: forwards by module class, the
state's shapes) and its line in `KINDS`; a model whose recurrent module is of a class no
kind names is refused by `support` with that class in the message.
"""

from __future__ import annotations

import types

import torch
from transformers import PreTrainedModel

from engine.errors import UnsupportedModelError
from engine.model.recurrent import gated_delta_net, mamba2, short_conv
from engine.model.recurrent.kind import RecurrentKind
from engine.model.recurrent.state import RecurrentLayout, RecurrentStates, RecurrentStep

KINDS: tuple[RecurrentKind, ...] = (gated_delta_net.KIND, mamba2.KIND, short_conv.KIND)
_BY_CLASS = {name: kind for kind in KINDS for name in kind.forwards}

__all__ = [
    "KINDS",
    "RecurrentLayout",
    "RecurrentStates",
    "RecurrentStep",
    "bind_recurrent",
    "recurrent_modules",
]


def recurrent_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's modules of a registered recurrent kind, by layer index."""
    return {
        int(module.layer_idx): module
        for module in model.modules()
        if type(module).__name__ in _BY_CLASS
    }


def bind_recurrent(model: PreTrainedModel) -> RecurrentLayout | None:
    """Replace the forward of each recurrent module of `model` by its kind's (each learns
    its state index, `state_index`) and return the layout of their state; None when the
    model has none. Raises `UnsupportedModelError` where its recurrent layers differ in
    kind or state shape (one state tensor per kind of state serves all of them)."""
    modules = recurrent_modules(model)
    if not modules:
        return None
    layouts = set()
    for index, layer in enumerate(sorted(modules)):
        module = modules[layer]
        kind = _BY_CLASS[type(module).__name__]
        layouts.add((kind.name, *kind.state(module)))
        module.state_index = index
        module.forward = types.MethodType(kind.forwards[type(module).__name__], module)
    if len(layouts) != 1:
        raise UnsupportedModelError(
            f"its recurrent layers differ in kind or state shape ({sorted(map(str, layouts))})"
        )
    kind_name, conv_shape, ssm_shape = layouts.pop()
    return RecurrentLayout(kind_name, tuple(sorted(modules)), conv_shape, ssm_shape)
