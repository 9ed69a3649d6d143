"""LoRA on a model's linear projections, a different adapter (or none) per row of one
step: S-LoRA's and punica's design, on the CPU's row-invariant linears.

`LoRASlots.wrap` replaces each adaptable projection (`ADAPTABLE`) by a `LoRALinear` around
it. Every one of them holds the A and B matrices of all `max_loras` slots stacked,
`A [slots * max_rank, in]` and `B [out, slots * max_rank]`, zeros where a slot has no
adapter, a smaller rank or no weights for that projection. A step's rows name their slot
(`set_step`: one per token, -1 for the base model); a projection computes its base output
for every row, then for the rows with an adapter `h = x A^T`, keeps the columns of each
row's own slot times its adapter's scaling (a 0/scaling mask), and adds `h B^T` (peft
scales after B: the same value, rounded once differently unless the scaling is a power of
two, as `lora_alpha = 2 r` makes it).

Invariant: a row's bits depend only on the row, its slot and the slots' weights, never on
the step's other rows: both products run on oneDNN's packed fp32 linear, which gives a row
the same bits at any row count (`engine.linears.packed_linear`), and the mask and the add
are elementwise; the other slots' columns of `h` are zeros after the
mask, and adding their zero products changes no sum. Rows without an adapter are not
touched, so the base model's rows keep exactly the bits they have without LoRA.

The LoRA products run in fp32 whatever the model's dtype. `LoRALinear` is an
`OpaqueLinear`, so the compiled forward calls it back as it is, in its own op. Slots
change between steps only (`assign`, `clear`, on the engine's thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.linears.opaque_linear import OpaqueLinear
from engine.linears.packed_linear import can_pack, padded_rows
from engine.lora.adapter import LoRAAdapter

# The projections of a decoder layer LoRA adapters target, by module name (Llama's,
# Qwen's, Mistral's, Gemma's; Phi-3's fused ones).
ADAPTABLE = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
     "qkv_proj", "gate_up_proj"}
)  # fmt: skip


class _Product:
    """`x W^T` in fp32 for a weight that changes between steps: oneDNN's packed linear on
    the CPU (row-invariant from two rows: one row is padded to two), `F.linear` elsewhere."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if can_pack(weight.device, torch.float32)
            else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return y[:rows]


@dataclass(slots=True)
class _Step:
    """The rows of a step that have an adapter: their indices (None: every row has one),
    and each one's column mask over the stacked ranks, times its scaling."""

    rows: torch.Tensor | None
    scaled_mask: torch.Tensor


class LoRASlots:
    """The `max_loras` adapter slots of one model, and the step's rows' slots."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.layers: dict[str, LoRALinear] = {}
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self.step: _Step | None = None
        width = max_loras * max_rank
        self._bands = torch.zeros(max_loras, width, device=device)
        self._scaling = torch.zeros(max_loras, device=device)

    def wrap(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """Put a `LoRALinear` around each adaptable projection of `model`; return their
        shapes by module path, (in_features, out_features)."""
        for path, module in list(model.named_modules()):
            name = path.rpartition(".")[2]
            if name not in ADAPTABLE or isinstance(module, LoRALinear):
                continue
            in_features, out_features = _features(module)
            parent = model.get_submodule(path.rpartition(".")[0])
            wrapped = LoRALinear(module, in_features, out_features, self)
            setattr(parent, name, wrapped)
            self.layers[path] = wrapped
        return {
            path: (layer.in_features, layer.out_features) for path, layer in self.layers.items()
        }

    def assign(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter`'s weights in `slot` (every layer: the ones it lacks are zeros)."""
        for path, layer in self.layers.items():
            layer.set_slot(slot, adapter.weights.get(path), adapter.rank)
        self.adapters[slot] = adapter
        band = torch.zeros(self.max_loras * self.max_rank, device=self.device)
        band[slot * self.max_rank : slot * self.max_rank + adapter.rank] = 1.0
        self._bands[slot] = band
        self._scaling[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None, 0)
        self.adapters[slot] = None
        self._bands[slot] = 0.0
        self._scaling[slot] = 0.0

    def set_step(self, token_slots: np.ndarray) -> None:
        """The slot of each of the step's tokens, in the batch's order (-1: none)."""
        active = np.flatnonzero(token_slots >= 0)
        if not active.size:
            self.step = None
            return
        slots = torch.from_numpy(token_slots[active]).to(self.device)
        rows = None if active.size == token_slots.size else torch.from_numpy(active)
        self.step = _Step(
            None if rows is None else rows.to(self.device),
            self._bands[slots] * self._scaling[slots].unsqueeze(1),
        )


class LoRALinear(OpaqueLinear):
    """A projection with every slot's LoRA on top; see the module docstring."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, slots: LoRASlots):
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = out_features
        self._slots = slots
        width = slots.max_loras * slots.max_rank
        self._a = torch.zeros(width, in_features, device=slots.device)
        self._b = torch.zeros(out_features, width, device=slots.device)
        self._products: tuple[_Product, _Product] | None = None

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None, rank: int):
        band = slice(slot * self._slots.max_rank, (slot + 1) * self._slots.max_rank)
        self._a[band] = 0.0
        self._b[:, band] = 0.0
        if weights is not None:
            a, b = weights
            self._a[band.start : band.start + rank] = a.to(self._a.device)
            self._b[:, band.start : band.start + rank] = b.to(self._b.device)
        # No product while no slot holds weights here: such a projection costs nothing.
        self._products = (_Product(self._a), _Product(self._b)) if bool(self._a.any()) else None

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self._slots.step
        if step is None or self._products is None:
            return y
        a, b = self._products
        x = x.reshape(-1, self.in_features)
        out = y.view(-1, self.out_features)
        if step.rows is None and x.shape[0] == step.scaled_mask.shape[0]:
            out.add_(b(a(x.float()) * step.scaled_mask).to(y.dtype))
            return y
        # Some rows have no adapter, or the step was padded with rows (compiled steps).
        rows = step.rows if step.rows is not None else torch.arange(step.scaled_mask.shape[0])
        delta = b(a(x.index_select(0, rows).float()) * step.scaled_mask)
        out.index_copy_(0, rows, out.index_select(0, rows) + delta.to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lora"


def _features(module: nn.Module) -> tuple[int, int]:
    in_features = getattr(module, "in_features", None)
    out_features = getattr(module, "out_features", None)
    if not isinstance(in_features, int) or not isinstance(out_features, int):
        raise TypeError(f"{type(module).__name__} does not say its in and out features")
    return in_features, out_features
