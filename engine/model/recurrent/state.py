"""The recurrent state of a hybrid model's recurrent layers: its shape per sequence
(`RecurrentLayout`), the slots that hold it (`RecurrentStates`, one tensor per kind of
state, like the paged KV tensor) and what one step reads and writes (`RecurrentStep`).

Slot `s` of recurrent layer `i` (its place among the model's recurrent layers) is
`conv[i, s]`, the last `kernel - 1` inputs of its causal convolution `[kernel - 1,
channels]`, and `ssm[i, s]`, its recurrent matrix (Gated DeltaNet's `[heads, key dim,
value dim]`, Mamba-2's `[heads, state size, head dim]`; none for a short convolution),
laid out so that the last axis is the one whose entries never meet (see the kernels).
Both are fp32, as the models' references compute them, so a state's bits never depend on
the compute dtype's rounding of the running state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model.kv_cache import zeros

STATE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class RecurrentLayout:
    """Which layers of a model keep recurrent state, and its shape per sequence.

    `layers` are the model's layer indices with a recurrent module, ascending (layer
    `layers[i]` keeps its state at index i); `kind` names their layer kind; every one
    keeps a convolution window `conv_shape` (kernel - 1, channels) and, unless
    `ssm_shape` is None, a recurrent matrix of that shape.
    """

    kind: str
    layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, ...] | None

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state across all its recurrent layers."""
        per_layer = math.prod(self.conv_shape) + math.prod(self.ssm_shape or ())
        return len(self.layers) * per_layer * STATE_DTYPE.itemsize


@dataclass(slots=True)
class RecurrentStates:
    """The slots of a model's recurrent state: `conv` `[layers, slots, kernel - 1,
    channels]` and `ssm` `[layers, slots, *ssm_shape]` (None for short convolutions), fp32.
    The last slot, `padding_slot`, is no sequence's: a compiled step's padding sequence
    writes its state there."""

    conv: torch.Tensor
    ssm: torch.Tensor | None

    @classmethod
    def allocate(
        cls, layout: RecurrentLayout, num_slots: int, device: torch.device
    ) -> RecurrentStates:
        """`num_slots` slots and the padding slot, zeroed; on the CPU an anonymous
        private memory map, as the KV cache, whose pages the kernel hands out when a slot
        is first written."""
        shape = (len(layout.layers), num_slots + 1)
        conv = zeros((*shape, *layout.conv_shape), STATE_DTYPE, device)
        if layout.ssm_shape is None:
            return cls(conv, None)
        return cls(conv, zeros((*shape, *layout.ssm_shape), STATE_DTYPE, device))

    @property
    def padding_slot(self) -> int:
        return self.conv.shape[1] - 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conv,) if self.ssm is None else (self.conv, self.ssm)


@dataclass(slots=True)
class RecurrentStep:
    """What a step's recurrent layers read and write, shared by every recurrent layer.

    Sequence b owns the packed rows `[query_start[b], query_start[b + 1])`; it starts from
    the state in slot `sources[b]` (-1: an empty state, all zeros) and leaves its state
    after its last row in slot `slots[b]`. For each i, the state after packed row
    `checkpoint_rows[i]` (its sequence's) is also copied to slot `checkpoint_slots[i]`; a
    negative row copies nothing (padding: the arrays never have size 0). Sources are never
    written by another sequence of the step, so the sequences can run in any order.
    `use_kernel`: run the C++ ops (else the torch reference, `torch_ops`).
    """

    states: RecurrentStates
    query_start: torch.Tensor
    slots: torch.Tensor
    sources: torch.Tensor
    checkpoint_rows: torch.Tensor
    checkpoint_slots: torch.Tensor
    use_kernel: bool
