"""Linear layers that `torch.compile` calls as they are, through one registered op.

The packed and quantized linears hold weights that compiled code cannot take: oneDNN's
packed weight is an opaque mkldnn tensor, which fake tensors do not model, and Inductor,
left to lower linears itself, turns them into MKL GEMMs, which lose oneDNN's packing and
its row invariance (see `packed_linear`). So such a layer, while being compiled, emits one
call of `pagedserve::linear(x, handle)`, and the compiled graph calls back into the
layer's own eager `compute` at run time, with the same bits as the eager engine.

Invariant: `handle` is the lowest free index of this process's registry when the layer
is made, so a process that builds the same model the same way gives every layer the same
handle (the handles are constants in compiled graphs, and so in saved graphs' keys and
Inductor's on-disk cache keys), and so does one that builds it again after the engine
that held the first copy was dropped: a dead layer's handle is free again, and
`free_dropped_handles` collects dropped engines first. A second engine built while the
first lives gets other handles, and so another compiled graph. The registry holds weak
references: a layer's entry dies with the layer.
"""

from __future__ import annotations

import gc
import weakref
from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.model.kernels.custom_ops import LIBRARY

_layers: list[weakref.ref[OpaqueLinear]] = []


class OpaqueLinear(nn.Module, ABC):
    """Base of linears computed by `compute(x)`; subclasses set `in_features` and
    `out_features` and implement `compute`, which must return a contiguous tensor."""

    in_features: int
    out_features: int

    def __init__(self) -> None:
        super().__init__()
        free = (handle for handle, entry in enumerate(_layers) if entry() is None)
        self.handle = next(free, len(_layers))
        if self.handle == len(_layers):
            _layers.append(weakref.ref(self))
        else:
            _layers[self.handle] = weakref.ref(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pagedserve.linear(x, self.handle)
        return self.compute(x)

    @abstractmethod
    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T (+ b)` over the last axis of `x`, computed eagerly."""


def free_dropped_handles() -> None:
    """Collect the layers of engines that were dropped but wait in reference cycles, so
    that their handles are free before a model's linears are replaced."""
    gc.collect()


def layer(handle: int) -> OpaqueLinear:
    layer = _layers[handle]()
    if layer is None:
        raise RuntimeError(f"linear layer {handle} was freed while compiled code still calls it")
    return layer


# Called once per linear of a compiled step (211 in SmolLM2): see `custom_ops.LIBRARY`.
LIBRARY.define("linear(Tensor x, int handle) -> Tensor")


def opaque_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """`compute(x)` of the registered layer `handle` (the op's CPU kernel)."""
    return layer(handle).compute(x)


LIBRARY.impl("linear", opaque_linear, "CPU")


def fake_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """The output of layer `handle` on `x` in shape and dtype alone (a linear op's fake
    kernel, for tracing)."""
    return x.new_empty(*x.shape[:-1], layer(handle).out_features)


def fake_linear_group(x: torch.Tensor, handles: list[int]) -> torch.Tensor:
    """The outputs of layers `handles` on one `x`, side by side, in shape and dtype alone
    (a grouped linear op's fake kernel, for tracing)."""
    return x.new_empty(*x.shape[:-1], sum(layer(handle).out_features for handle in handles))


torch.library.register_fake("pagedserve::linear")(fake_linear)
