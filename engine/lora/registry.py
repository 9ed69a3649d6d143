"""The adapters one engine serves: their names, slots and prefix-cache roots.

Reading an adapter (`read`: its files, checked against the model) may run on any thread;
`add` and `remove` change the slots and run on the engine's thread, between steps. A
removed adapter's name is gone at once (a new request naming it is refused), and its slot
is cleared once no unfinished sequence uses it (`free_unused`).

An adapter's blocks never meet another's or the base model's in the prefix cache: its
sequences chain their first block onto `root`, a hash of the adapter's weights and
scaling (so the same adapter loaded again, or after a restart, finds its own blocks in the
cache and the disk tier, and different weights under one name never do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import xxhash

from engine.adapters import ServedAdapter
from engine.errors import AdapterError
from engine.lora.adapter import LoRAAdapter, read_adapter
from engine.lora.layers import LoRASlots


class LoRARegistry:
    """`engine.adapters.Adapters` over one model's `LoRASlots`."""

    def __init__(self, slots: LoRASlots, shapes: Mapping[str, tuple[int, int]]) -> None:
        self.slots = slots
        self.shapes = shapes
        self._served: dict[str, ServedAdapter] = {}
        self._removed: list[ServedAdapter] = []

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at `path`, checked against this model (any thread)."""
        return read_adapter(name, path, self.shapes, self.slots.max_rank)

    def add(self, adapter: object) -> ServedAdapter:
        """Serve `adapter` in a free slot; AdapterError if its name is taken or every slot
        is (`max_loras`)."""
        assert isinstance(adapter, LoRAAdapter)
        if adapter.name in self._served:
            raise AdapterError(f"an adapter named '{adapter.name}' is loaded already")
        taken = {served.slot for served in (*self._served.values(), *self._removed)}
        free = [slot for slot in range(self.slots.max_loras) if slot not in taken]
        if not free:
            raise AdapterError(
                f"cannot load adapter '{adapter.name}': max_loras ({self.slots.max_loras}) "
                "adapters are loaded; unload one first"
            )
        self.slots.assign(free[0], adapter)
        served = ServedAdapter(adapter.name, adapter.path, adapter.rank, free[0], _root(adapter))
        self._served[adapter.name] = served
        return served

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not served); its slot frees later."""
        self._removed.append(self._served.pop(name))

    def free_unused(self, used_slots: Iterable[int]) -> None:
        """Clear the slots of removed adapters that no unfinished sequence uses."""
        used = set(used_slots)
        for served in [served for served in self._removed if served.slot not in used]:
            self.slots.clear(served.slot)
            self._removed.remove(served)

    @property
    def removing(self) -> bool:
        return bool(self._removed)

    def set_step(self, token_slots: np.ndarray) -> None:
        self.slots.set_step(token_slots)

    def get(self, name: str) -> ServedAdapter | None:
        return self._served.get(name)


def _root(adapter: LoRAAdapter) -> int:
    digest = xxhash.xxh3_64(repr(adapter.scaling).encode())
    for path, (a, b) in sorted(adapter.weights.items()):
        digest.update(path.encode())
        digest.update(a.numpy().tobytes())
        digest.update(b.numpy().tobytes())
    return digest.intdigest()
