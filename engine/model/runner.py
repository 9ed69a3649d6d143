"""One packed forward per engine step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from cache import cdiv
from engine.model.step_executor import EagerSteps, StepExecutor
from engine.model.step_inputs import BlockTables, Staging, build_step_inputs
from scheduler import ScheduledSequence, SchedulerOutput


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

    Steps run through `executor` (see `engine.model.step_executor`): `eager`, or what
    `step_path` makes of it (`engine.capabilities.step_executor`: the compiled forward or
    the decode graphs). Call `warm_up` before the first step: it compiles the forward or
    captures the graphs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        step_path: Callable[[EagerSteps], StepExecutor] | None = None,
        mirror_block_tables: bool | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        # A separate copy of the block tables that follows by changed entries: always off
        # the CPU; on the CPU the host table itself serves, unless a test asks for a copy.
        mirror = self.device.type != "cpu" if mirror_block_tables is None else mirror_block_tables
        self.block_tables = BlockTables(
            max_num_seqs, cdiv(max_model_len, block_size), track_changes=mirror
        )
        table = torch.from_numpy(self.block_tables.table)  # the host table's own memory
        self._device_tables = table.clone().to(self.device) if mirror else table
        self._staging = Staging(self.device)
        self.eager = EagerSteps(model, kv_cache, self._device_tables)
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
