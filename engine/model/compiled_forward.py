"""The model's forward compiled by Inductor, for every step on the CPU (`enforce_eager: false`).

An eager forward of a small model dispatches thousands of small ops a step (SmolLM2 at
batch 1: 2,888, counted by `bench.step_profile`; compiled: 447), each with its own
dispatch overhead. Compiled, the
norms, rotary embeddings, activations and residual adds become a few fused C++ loops,
while the three kinds of call that hold the arithmetic stay what they are in eager mode:
the linears (`opaque_linear`: oneDNN packed or int8, called back eagerly), the K/V store
and the C++ paged attention (`kernels.custom_ops`).

One graph serves every step, prefill and decode alike: its token, sequence and
sampled-row counts are dynamic, so nothing is compiled per batch size and no step falls
back to eager mode. Dynamic sizes are never 0 or 1 (Inductor would specialize those), so
a step with fewer than two sampled rows gets one padding sequence: one token at position
0 that writes no KV slot (slot -1) and reads one slot of block table row 0, whose first
entry always names a block that exists, sampled once or twice; its logits are dropped.
The cost: a batch-1 decode step computes two rows, and the K/V store drops the padding
row by a mask in every layer. (Marking the sizes unbacked instead of padding compiled
without specializing, but the step measured no faster, so the padding stays.)

Invariants:
- A row's bits depend only on the row, never on the step's other rows or sizes: the
  linears and the attention are row-invariant, and the compiled loops compute each row
  alone (tests check it). They are not the eager engine's bits: Inductor's fused code
  rounds differently (SmolLM2's fp32 logits differed by up to 1.4e-4 in one check;
  greedy tokens matched eager mode's in the tests).
- Inductor keeps what it builds under `$PAGEDSERVE_CACHE/inductor` (unless
  `TORCHINDUCTOR_CACHE_DIR` is set), so a restart that builds the same model retraces the
  graph but does not run the C++ compiler again.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable

import numpy as np
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from engine.config import ConfigError, cache_root
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.decode_graphs import PADDING_ROW, Forward
from engine.model.step_inputs import StepInputs

logger = logging.getLogger(__name__)

CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled code: `TORCHINDUCTOR_CACHE_DIR` if a user set it, else
    `$PAGEDSERVE_CACHE/inductor` (set into the variable, which Inductor reads at every
    use). Torch writes its own default (a folder in /tmp) into the variable the first time
    it needs one, so that value counts as unset."""
    current = os.environ.get(CACHE_DIR_VARIABLE)
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_DIR_VARIABLE] = str(cache_root() / "inductor")
    return os.environ[CACHE_DIR_VARIABLE]


def pad_step(step: StepInputs) -> StepInputs:
    """`step` itself if it samples at least two rows, else with one padding sequence
    appended (see the module's docstring) whose token is sampled until two rows are: its
    logits rows come last. (A prefill chunk that ends before its prompt does samples none.)
    """
    missing = 2 - len(step.logits_index)
    if missing <= 0:
        return step
    token = len(step.input_ids)
    input_id, position, slot, context, row = PADDING_ROW
    return StepInputs(
        input_ids=np.append(step.input_ids, input_id),
        positions=np.append(step.positions, position),
        slots=np.append(step.slots, slot),
        rows=np.append(step.rows, row),
        query_start=np.append(step.query_start, token + 1),
        context_lens=np.append(step.context_lens, context),
        logits_index=np.append(step.logits_index, [token] * missing),
        width=step.width,
    )


class CompiledForward:
    """`(input_ids [T], positions [T], slots [T], rows [B], query_start [B + 1],
    context_lens [B], logits_index [S]) -> logits [S, vocab]` through one compiled graph;
    inputs come from `pad_step`. Block tables are read whole (every column) from
    `device_tables` by row, so their width is not a dimension of the graph."""

    def __init__(
        self, forward: Forward, kv_cache: torch.Tensor, device_tables: torch.Tensor
    ) -> None:
        if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
            raise ConfigError(
                "enforce_eager false compiles the forward, but TORCHDYNAMO_DISABLE=1 is set"
            )
        inductor_cache_dir()
        self._model_forward = forward
        # Static: Dynamo would give their sizes symbols shared with equal step sizes (the
        # K/V axis of 2 with a step's 2 sampled rows), specialized where they are indexed.
        torch._dynamo.mark_static(kv_cache)
        torch._dynamo.mark_static(device_tables)
        self._kv_cache = kv_cache
        self._tables = device_tables
        # The model's modules never change after loading, so the guards on them (most of the
        # 0.8 ms that checking a call's guards took a SmolLM2 step) are dropped; that is
        # safe only because this engine's forward has a cache of its own (`_own_code`).
        self._compiled = torch.compile(
            _own_code(self._forward),
            dynamic=True,
            fullgraph=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._compiled(*inputs, self._kv_cache, self._tables)

    def warm_up(self) -> float:
        """Compile (or load from the cache) by running one step of padding tokens; return
        the seconds it took. Writes no KV slot. Raises `ConfigError` if Inductor cannot
        build here (no C++ compiler, for one).

        The step's sizes all differ (5 tokens, 3 sequences, 2 sampled), because Dynamo
        gives equal sizes one symbol: a first step with as many tokens as sequences would
        compile a graph for decode steps only, and the first prefill would compile again.
        """
        lengths = np.array([1, 2, 2])
        starts = np.concatenate(([0], np.cumsum(lengths)))
        step = StepInputs(
            input_ids=np.zeros(starts[-1], dtype=np.int64),
            positions=np.concatenate([np.arange(n) for n in lengths]),
            slots=np.full(starts[-1], -1),
            rows=np.zeros(len(lengths), dtype=np.int64),
            query_start=starts,
            context_lens=lengths,
            logits_index=starts[1:3] - 1,
            width=1,
        )
        inputs = [torch.from_numpy(array.astype(np.int64)) for array in step.arrays()]
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                self(*inputs)
        except Exception as exc:  # Inductor fails in many ways where it cannot build
            raise ConfigError(
                f"enforce_eager false: the forward cannot be compiled here: {exc}"
            ) from exc
        seconds = time.perf_counter() - started
        logger.info("compiled forward ready in %.1f s (cache: %s)", seconds, inductor_cache_dir())
        return seconds

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        logits_index: torch.Tensor,
        kv_cache: torch.Tensor,
        device_tables: torch.Tensor,
    ) -> torch.Tensor:
        tables = device_tables.index_select(0, rows)
        metadata = PagedAttentionMetadata.device_only(
            kv_cache, slots, tables, query_start, context_lens, max_query_len=0
        )
        return self._model_forward(input_ids[None], positions[None], logits_index, metadata)


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`method` bound to a copy of its function with a code object of its own. Dynamo keeps
    compiled graphs per code object: without the copy, a second engine in the process would
    share the first one's cache, and with the guards on the model's modules dropped it would
    run the first engine's graph, whose linear ops name the first model's layers."""
    function = method.__func__  # type: ignore[attr-defined]
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]
