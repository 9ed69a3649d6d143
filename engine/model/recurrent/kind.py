"""What a recurrent layer kind is: the forwards that replace transformers' modules of that
kind, by module class, and the state each module keeps per sequence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.recurrent.state import RecurrentStep

# A module's replacement forward: (module, hidden_states [1, T, hidden], **transformers'
# keyword arguments, the runner's paged_metadata among them) -> [1, T, hidden].
Forward = Callable[..., torch.Tensor]
# A module's state per sequence: (convolution window shape, recurrent matrix shape or None).
StateShapes = Callable[[Any], tuple[tuple[int, int], tuple[int, ...] | None]]


@dataclass(frozen=True)
class RecurrentKind:
    """A kind of recurrent layer: `forwards` maps the transformers module classes of this
    kind (by class name) to the forward that runs one over a packed step; `state` gives a
    module's per-sequence state shapes."""

    name: str
    forwards: dict[str, Forward]
    state: StateShapes


def recurrent_step(module: torch.nn.Module, arguments: dict[str, Any]) -> RecurrentStep:
    """The step's `RecurrentStep`, from the runner's `paged_metadata` among the keyword
    arguments transformers passes a token mixer."""
    metadata = arguments.get("paged_metadata")
    step = None if metadata is None else metadata.recurrent
    if step is None:
        raise RuntimeError(
            f"{type(module).__name__} runs under pagedserve's model runner only: no recurrent "
            "state in paged_metadata"
        )
    return step


def conv_window(conv: torch.nn.Conv1d) -> tuple[int, int]:
    """The state of a depthwise causal convolution: its last kernel - 1 inputs, `[kernel -
    1, channels]`."""
    return conv.kernel_size[0] - 1, conv.in_channels
