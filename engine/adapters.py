"""What the engine's core asks of the LoRA component (engine/lora/, reached through
`engine.capabilities.lora_adapters`): the adapters one model serves, by name.

Reading an adapter (`read`) may run on any thread; the rest runs on the engine's thread,
`add` and `remove` between steps. A sequence of an adapter carries its `slot` into every
step (`set_step`: each token's slot, -1 for the base model) and chains its first block
onto its `root`, so that the prefix cache never shares its blocks with another adapter or
the base model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """An adapter in a slot: its name, folder, rank, slot and prefix-cache root."""

    name: str
    path: str
    rank: int
    slot: int
    root: int


class Adapters(Protocol):
    def read(self, name: str, path: str) -> object:
        """The adapter in folder `path`, checked against the model; AdapterError if not."""

    def add(self, adapter: object) -> ServedAdapter:
        """Serve an adapter `read` returned; AdapterError if its name or no slot is free."""

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not served); its slot frees once no
        unfinished sequence uses it (`free_unused`)."""

    def free_unused(self, used_slots: Iterable[int]) -> None: ...

    def get(self, name: str) -> ServedAdapter | None: ...

    @property
    def removing(self) -> bool:
        """Whether a removed adapter's slot waits to be freed."""

    def set_step(self, token_slots: np.ndarray) -> None:
        """The slot of each token of the next step, in the batch's order (-1: none)."""
