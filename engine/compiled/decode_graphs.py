"""Decode steps over static, bucket-padded inputs, replayed from CUDA graphs; every other
step runs eagerly.

A decode step of B sequences runs as the smallest bucket >= B: its inputs are copied into
the bucket's static buffer, padded with rows that write no KV slot and read one token of
a block that exists, and the forward captured for that bucket replays. Buckets are 1, 2,
4, then every multiple of 8 up to `max_num_seqs` rounded up to 8; larger batches and
steps with prefill chunks run eagerly.

Invariants: a bucket's static buffer and its attention metadata keep their addresses from
capture to every replay; the captured forward reads only device tensors (an attention
backend that `captures`, Triton's; the engine refuses others here) and the
block tables through the runner's device copy, gathered inside the graph by row.

Without CUDA (Triton's interpreter, for tests) nothing is captured: the same static,
padded forward runs eagerly, so the bucketing and padding are tested on the CPU. On CUDA
this is the default decode path with the Triton backend (`enforce_eager` unset or false);
captured and replayed on an H100, it gave `generate()`'s fp32 tokens (docs/gpu.md).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.runner import EagerSteps, model_logits
from engine.model.step_inputs import StepInputs

# Per row of a bucket's static buffer: input id, position, slot, context length, table row.
FIELDS = 5
# A padding row: token 0 at position 0, no KV slot written, a context of one token read
# through table row 0 (its first entry is always a block id that exists).
PADDING_ROW = (0, 0, -1, 1, 0)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs rounded to 8."""
    top = -(-max_num_seqs // 8) * 8
    return [size for size in (1, 2, 4) if size < top] + list(range(8, top + 1, 8))


class DecodeGraphs:
    """A `StepExecutor`: one static buffer (and, on CUDA, one captured graph) per decode
    bucket; the steps that do not `fit` run through `eager`."""

    name = "graphs"

    def __init__(self, eager: EagerSteps, max_num_seqs: int) -> None:
        self.buckets = decode_buckets(max_num_seqs)
        self._eager = eager
        self._model = eager.model
        self._kv_caches = eager.kv_caches
        self._tables = eager.device_tables
        device = eager.kv_caches[0].device
        self._static = {
            size: torch.tensor(PADDING_ROW * size, dtype=torch.int64, device=device)
            .view(size, FIELDS)
            .T.contiguous()
            for size in self.buckets
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def warm_up(self) -> None:
        """Capture the graphs on CUDA; elsewhere (Triton's interpreter) nothing to do."""
        if self._tables.device.type == "cuda":
            self.capture()

    def host_inputs(self, step: StepInputs) -> tuple[np.ndarray, ...]:
        if not self.fits(step):
            return step.arrays()
        return (self.bucket_inputs(step),)

    def run(self, step: StepInputs, inputs: list[torch.Tensor]) -> torch.Tensor:
        if not self.fits(step):
            return self._eager.run(step, inputs)
        return self.replay(step, inputs[0])

    def fits(self, step: StepInputs) -> bool:
        return step.is_decode and step.num_seqs <= self.buckets[-1]

    def bucket(self, num_seqs: int) -> int:
        return next(size for size in self.buckets if size >= num_seqs)

    def bucket_inputs(self, step: StepInputs) -> np.ndarray:
        """The step's rows, padded to its bucket, laid out as the bucket's static buffer."""
        size = self.bucket(step.num_seqs)
        fields = np.tile(np.asarray(PADDING_ROW, dtype=np.int64)[:, None], (1, size))
        columns = (step.input_ids, step.positions, step.slots, step.context_lens, step.rows)
        for field, column in enumerate(columns):
            fields[field, : step.num_seqs] = column
        return fields.reshape(-1)

    def replay(self, step: StepInputs, inputs: torch.Tensor) -> torch.Tensor:
        """Logits `[B, vocab]` of a step that `fits`; `inputs` is `bucket_inputs` on the
        device."""
        size = self.bucket(step.num_seqs)
        self._static[size].view(-1).copy_(inputs)
        if size in self._graphs:
            self._graphs[size].replay()
            logits = self._outputs[size]
        else:
            logits = self._static_forward(size)
        return logits[: step.num_seqs]

    def capture(self) -> None:
        """Capture every bucket's forward, largest first, into one memory pool (CUDA)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._static_forward(size)  # warm-up: compiles the Triton kernels for the shapes
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._static_forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def _static_forward(self, size: int) -> torch.Tensor:
        input_ids, positions, slots, context_lens, rows = self._static[size]
        device = self._tables.device
        every_row = torch.arange(size + 1, dtype=torch.int64, device=device)
        metadata = PagedAttentionMetadata.of_step(
            self._kv_caches, self._tables, slots, rows, every_row, context_lens, max_query_len=1
        )
        return model_logits(
            self._model, input_ids[None], positions[None], every_row[:size], metadata
        )
