"""How a step's packed inputs become logits: the interface every step path implements, and
the eager path, which is always there.

The runner packs a step (`StepInputs`), asks its executor for the host arrays to upload,
copies them to the device in one copy, and hands the device tensors back to `run`. The
eager path below runs the model on them as they are; the compiled forward and the decode
graphs (`engine.compiled`, an optional component chosen by `engine.capabilities`) pad or bucket
them first, and fall back to this path for steps they do not take.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.model_forward import model_logits
from engine.model.step_inputs import StepInputs


class StepExecutor(Protocol):
    """One way to run a step. `host_inputs(step)` are the int64 arrays to put on the
    device; `run(step, inputs)`, given them there in the same order, returns the logits
    `[len(step.logits_index), vocab]` in the model's dtype, one row per entry of
    `logits_index`, in its order. A row's logits depend on that row alone, never on the step's other
    rows. `warm_up` runs once before the first step (it compiles or captures)."""

    name: str

    def warm_up(self) -> None: ...

    def host_inputs(self, step: StepInputs) -> tuple[np.ndarray, ...]: ...

    def run(self, step: StepInputs, inputs: list[torch.Tensor]) -> torch.Tensor: ...


class EagerSteps:
    """Every step through the model object itself, with the step's host arrays at hand for
    attention backends that read them. Holds what every step path shares: the model, the
    KV cache and the device's block tables (read by row)."""

    name = "eager"

    def __init__(
        self, model: PreTrainedModel, kv_cache: torch.Tensor, device_tables: torch.Tensor
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device_tables = device_tables

    def warm_up(self) -> None:
        """Nothing to prepare."""

    def host_inputs(self, step: StepInputs) -> tuple[np.ndarray, ...]:
        return step.arrays()

    def run(self, step: StepInputs, inputs: list[torch.Tensor]) -> torch.Tensor:
        input_ids, positions, slots, rows, query_start, context_lens, logits_index = inputs
        metadata = PagedAttentionMetadata.of_step(
            self.kv_cache, self.device_tables, slots, rows, query_start, context_lens, step
        )
        return model_logits(self.model, input_ids[None], positions[None], logits_index, metadata)
