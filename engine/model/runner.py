"""Running one engine step: the scheduled chunks packed into one batch, one forward of the
model over it, the sampling logits out.

`ModelRunner` packs the step (`StepInputs`), keeps the block tables across steps, asks
its `StepExecutor` for the host arrays to upload, copies them to the device in one copy
and hands the device tensors back to the executor's `run`. `EagerSteps` is the step path
that is always there: the model object run on the inputs as they are; the compiled
forward and the decode graphs (`engine.compiled`, an optional component chosen by
`engine.capabilities`) pad or bucket the inputs first and fall back to it for steps they
do not take. Every path runs the model through `model_logits`, so they differ only in how
the step's inputs reach it.

Invariants: a logits row depends on its own token's row alone, never on the step's other
rows; rows come out in `logits_index` order (the sampled rows in batch order, then the
prompt-logprob rows in batch order); the block tables have seen every `SchedulerOutput`,
in order, before a step that reads them runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from cache import cdiv
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.recurrent.state import RecurrentStates, RecurrentStep
from engine.model.step_inputs import BlockTables, Staging, StepInputs, build_step_inputs
from scheduler import ScheduledSequence, SchedulerOutput


def model_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_index: torch.Tensor,
    metadata: PagedAttentionMetadata,
) -> torch.Tensor:
    """`(input ids [1, T], positions [1, T], logits index [S], metadata) -> logits [S,
    vocab]` in the model's dtype: the step's tokens as one sequence whose attention the
    paged implementation splits by `metadata`, logits only at `logits_index`."""
    output = model(
        input_ids=input_ids,
        position_ids=positions,
        logits_to_keep=logits_index,
        use_cache=False,
        paged_metadata=metadata,
    )
    return output.logits[0]


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
    KV tensors (one per K/V shape), the device's block tables (read by row) and a hybrid
    model's recurrent states (run by their C++ ops where `recurrent_kernels`, else by
    torch)."""

    name = "eager"

    def __init__(
        self,
        model: PreTrainedModel,
        kv_caches: tuple[torch.Tensor, ...],
        device_tables: torch.Tensor,
        states: RecurrentStates | None = None,
        recurrent_kernels: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device_tables = device_tables
        self.states = states
        self.recurrent_kernels = recurrent_kernels

    def recurrent_step(
        self, query_start: torch.Tensor, state: list[torch.Tensor]
    ) -> RecurrentStep | None:
        """The step's `RecurrentStep` from its four state inputs (none: no recurrent
        layers)."""
        if self.states is None:
            return None
        return RecurrentStep(self.states, query_start, *state, use_kernel=self.recurrent_kernels)

    def warm_up(self) -> None:
        """Nothing to prepare."""

    def host_inputs(self, step: StepInputs) -> tuple[np.ndarray, ...]:
        return step.arrays()

    def run(self, step: StepInputs, inputs: list[torch.Tensor]) -> torch.Tensor:
        input_ids, positions, slots, rows, query_start, context_lens, logits_index, *state = inputs
        metadata = PagedAttentionMetadata.of_step(
            self.kv_caches, self.device_tables, slots, rows, query_start, context_lens, step,
            recurrent=self.recurrent_step(query_start, state),
        )  # fmt: skip
        return model_logits(self.model, input_ids[None], positions[None], logits_index, metadata)


class ModelRunner:
    """Packs the scheduled chunks into one batch, runs the model, returns sampling logits.

    Every token is a query row of paged attention (see `PagedAttentionMetadata`). Logits
    are computed only at the positions each sampling chunk samples at (its last, and with
    draft tokens one more per draft), in batch order, then at each chunk's prompt-logprob
    positions (`ScheduledSequence.num_prompt_logprob_rows`), in batch order.
    Block tables live in `block_tables`, kept across steps from the scheduler's outputs:
    call `update_block_tables` with every `SchedulerOutput`, in order, before `execute`.
    On a GPU a copy of them stays on the device and follows by changed entries only, and
    a step's inputs and those entries reach the device in one copy (see `Staging`);
    `mirror_block_tables=True` keeps such a copy on the CPU too (to test it there).
    A hybrid model's recurrent `states` go with the KV cache (see `EagerSteps`).

    Steps run through `executor`: `eager`, or what `step_path` makes of it
    (`engine.capabilities.step_executor`: the compiled forward or the decode graphs). Call
    `warm_up` before the first step: it compiles the forward or captures the graphs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        kv_caches: tuple[torch.Tensor, ...],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        step_path: Callable[[EagerSteps], StepExecutor] | None = None,
        mirror_block_tables: bool | None = None,
        states: RecurrentStates | None = None,
        recurrent_kernels: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        # A separate copy of the block tables that follows by changed entries: always off
        # the CPU; on the CPU the host table itself serves, unless a test asks for a copy.
        mirror = self.device.type != "cpu" if mirror_block_tables is None else mirror_block_tables
        self.block_tables = BlockTables(
            max_num_seqs, cdiv(max_model_len, block_size), track_changes=mirror
        )
        table = torch.from_numpy(self.block_tables.table)  # the host table's own memory
        self._device_tables = table.clone().to(self.device) if mirror else table
        self._staging = Staging(self.device)
        self.eager = EagerSteps(model, kv_caches, self._device_tables, states, recurrent_kernels)
        self.executor: StepExecutor = self.eager if step_path is None else step_path(self.eager)

    def update_block_tables(self, batch: SchedulerOutput) -> None:
        self.block_tables.update(batch)

    @torch.inference_mode()
    def warm_up(self) -> None:
        self.executor.warm_up()

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Return float32 logits `[sampled rows + prompt-logprob rows, vocab]`
        (`SchedulerOutput.num_sampled_rows`, then `num_prompt_logprob_rows`)."""
        step = build_step_inputs(scheduled, self.block_tables, self.block_size)
        changed_at, changed_ids = self.block_tables.drain_changes()
        *inputs, changed_at, changed_ids = self._staging.upload(
            *self.executor.host_inputs(step), changed_at, changed_ids
        )
        if changed_at.numel():
            self._device_tables.view(-1)[changed_at] = changed_ids
        return self.executor.run(step, inputs).float()
