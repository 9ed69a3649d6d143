"""One packed forward per engine step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from cache import cdiv
from engine.compiled.compiled_forward import CompiledForward, pad_step
from engine.compiled.decode_graphs import DecodeGraphs
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.block_tables import BlockTables
from engine.model.model_forward import model_logits
from engine.model.step_inputs import Staging, StepInputs, build_step_inputs
from scheduler import ScheduledSequence, SchedulerOutput


class ModelRunner:
    """Packs the scheduled chunks into one batch, runs the model, returns sampling logits.

    Every token is a query row of paged attention (see `PagedAttentionMetadata`). Logits
    are computed only at the positions each sampling chunk samples at (its last, and with
    draft tokens one more per draft), in batch order.
    Block tables live in `block_tables`, kept across steps from the scheduler's outputs:
    call `update_block_tables` with every `SchedulerOutput`, in order, before `execute`.
    On a GPU a copy of them stays on the device and follows by changed entries only, and
    a step's inputs and those entries reach the device in one copy (see `Staging`);
    `mirror_block_tables=True` keeps such a copy on the CPU too (to test it there).

    With `decode_graphs`, decode steps run through `DecodeGraphs`; the attention must
    then read device tensors only. With `compiled` (the CPU, the C++ attention kernel),
    every step runs through one `CompiledForward`. Call `warm_up` before the first step:
    it captures the CUDA graphs or compiles the forward.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        decode_graphs: bool = False,
        compiled: bool = False,
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
        self.graphs = (
            DecodeGraphs(self._forward, kv_cache, self._device_tables, max_num_seqs)
            if decode_graphs
            else None
        )
        self.compiled = CompiledForward(model, kv_cache, self._device_tables) if compiled else None

    def update_block_tables(self, batch: SchedulerOutput) -> None:
        self.block_tables.update(batch)

    @torch.inference_mode()
    def warm_up(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()
        if self.compiled is not None:
            self.compiled.warm_up()

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Return float32 logits `[scheduled sampled rows, vocab]` (`num_sampled_rows`)."""
        step = build_step_inputs(scheduled, self.block_tables, self.block_size)
        num_logits = len(step.logits_index)
        if self.compiled is not None:
            step = pad_step(step)
        changed_at, changed_ids = self.block_tables.drain_changes()
        if self.graphs is not None and self.graphs.fits(step):
            inputs, changed_at_, changed_ids_ = self._staging.upload(
                self.graphs.host_inputs(step), changed_at, changed_ids
            )
            self._follow_block_tables(changed_at_, changed_ids_)
            return self.graphs.run(step, inputs).float()
        *inputs, changed_at_, changed_ids_ = self._staging.upload(
            *step.arrays(), changed_at, changed_ids
        )
        self._follow_block_tables(changed_at_, changed_ids_)
        if self.compiled is not None:
            return self.compiled(*inputs)[:num_logits].float()
        return self._eager(step, *inputs).float()

    def _eager(
        self,
        step: StepInputs,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slots,
            block_tables=self._device_tables[rows, : step.width],
            query_start=query_start,
            context_lens=context_lens,
            query_start_host=step.query_start,
            context_lens_host=step.context_lens,
            positions_host=step.positions,
            max_query_len=step.max_query_len,
        )
        return self._forward(input_ids[None], positions[None], logits_index, metadata)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_index: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        return model_logits(self.model, input_ids, positions, logits_index, metadata)

    def _follow_block_tables(self, flat_index: torch.Tensor, block_ids: torch.Tensor) -> None:
        if flat_index.numel():
            self._device_tables.view(-1)[flat_index] = block_ids
