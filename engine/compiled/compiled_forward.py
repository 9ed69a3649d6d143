"""The model's forward compiled by Inductor, for every step on the CPU.

An eager forward of a small model dispatches thousands of small ops a step (SmolLM2 at
batch 1: 2,888, counted by `bench.step_profile`; compiled: 447), each with its own
dispatch overhead. Compiled, the
norms, rotary embeddings, activations and residual adds become a few fused C++ loops,
while the three kinds of call that hold the arithmetic stay what they are in eager mode:
the linears (`opaque_linear`: oneDNN packed or int8, called back eagerly), the K/V store
and the C++ paged attention (`kernels.custom_ops`).

The wrapper that calls the fused loops and the ops in turn is C++ as well (Inductor's
`cpp_wrapper`): its Python wrapper cost about 1 ms of SmolLM2's 8 ms int4 batch-1 step
(7.0 against 8.0 ms in alternating runs of one probe, 300-token contexts; 14.0 against
15.4 ms at batch 8), at the price of a longer first compile.

One graph serves every step, prefill and decode alike: its token, sequence and
sampled-row counts are dynamic, so nothing is compiled per batch size and no step falls
back to eager mode. The graph is traced size-obliviously
(`torch.fx.experimental._config.backed_size_oblivious`), so Inductor does not specialize
a size of 1 and a batch-1 decode step runs one row: padding it to two rows, as an earlier
graph did, cost a 1B Q4_K_M model's step 34 -> 48 ms on a 2-core CPU, whose quantized
linears are memory-bound at one row and not at two. A size of 0 is never traced: a step
that samples no row (a prefill chunk that ends before its prompt) gets one padding
sequence, one token at position 0 that writes no KV slot (slot -1) and reads one slot of
block table row 0, whose first entry always names a block that exists, sampled once; its
logits are dropped.

Compiled once per machine, model and settings. The graph is compiled ahead of time
(`torch.compile(...).aot_compile`, Dynamo's precompile) and saved to
`$PAGEDSERVE_CACHE/compiled/<key>/`; a later start loads it instead of tracing and
compiling again. The key hashes everything the graph bakes
in: torch, transformers and Python versions, the CPU's flags, this package's model
sources, the model's config and module tree (quantized or packed layers and their
handles), the dtype and the KV cache's and block table's shapes. Inductor's own output
(the compiled C++ and its libraries) stays under `$PAGEDSERVE_CACHE/inductor`, which a
load reads; loading still needs the C++ compiler Inductor keys its libraries by. A saved
graph that fails to load or to run is compiled anew. Concurrent first starts compile
once (`first_use.build_once`) and the others load that result.

Invariants:
- A row's bits depend only on the row, never on the step's other rows or sizes: the
  linears and the attention are row-invariant, and the compiled loops compute each row
  alone (tests check it). They are not the eager engine's bits: Inductor's fused code
  rounds differently (fp32 logits differ from eager mode's by its rounding; greedy tokens
  match eager mode's in the tests). A loaded graph is the saved one: its
  bits equal a fresh compile's.
- The saved graph keeps only its tensor inputs' guards (shapes, dtypes, strides): the
  key stands for the model's code and modules, which never change after loading. Those
  guards are checked on the warm-up step alone, so a graph saved for other shapes fails
  there, and then dropped (checking them is a sizeable share of a small step): every
  later step's inputs are built the same way (`pad_step`'s int64 arrays, never a size of
  0, and this engine's own KV cache and block tables), which is what the guards would
  check.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._inductor.config
import torch.fx.experimental._config
import transformers
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from transformers import PreTrainedModel

from engine.compiled.decode_graphs import PADDING_ROW
from engine.config import ConfigError, cache_root
from engine.first_use import build_once
from engine.linears.linear_groups import GroupSharedInputs
from engine.linears.opaque_linear import OpaqueLinear
from engine.model.attention_metadata import PagedAttentionMetadata
from engine.model.kernels.cpp_extension import cpu_flags
from engine.model.recurrent.state import RecurrentStates, RecurrentStep
from engine.model.runner import EagerSteps, model_logits
from engine.model.step_inputs import StepInputs

logger = logging.getLogger(__name__)

CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
# The saved graph inside its key's folder.
GRAPH_FILE = "forward.bin"
# Changes whenever the way a graph is built or saved changes, so old saves are not loaded.
FORMAT = "pagedserve-aot-1"


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled code: `TORCHINDUCTOR_CACHE_DIR` if a user set it, else
    `$PAGEDSERVE_CACHE/inductor` (set into the variable, which Inductor reads at every
    use). Torch writes its own default (a folder in /tmp) into the variable the first time
    it needs one, so that value counts as unset."""
    current = os.environ.get(CACHE_DIR_VARIABLE)
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_DIR_VARIABLE] = str(cache_root() / "inductor")
    return os.environ[CACHE_DIR_VARIABLE]


def pad_step(step: StepInputs, padding_slot: int = -1) -> StepInputs:
    """`step` itself if it samples a row, else with one padding sequence appended (see the
    module's docstring) whose token is sampled once: its logits row comes last. (A prefill
    chunk that ends before its prompt samples none.) A hybrid model's padding sequence
    starts from an empty state and leaves it in `padding_slot`, no sequence's."""
    if len(step.logits_index) > 0:
        return step
    token = len(step.input_ids)
    input_id, position, slot, context, row = PADDING_ROW
    state = step.state
    if state:
        slots, sources, *checkpoints = state
        state = (np.append(slots, padding_slot), np.append(sources, -1), *checkpoints)
    return StepInputs(
        input_ids=np.append(step.input_ids, input_id),
        positions=np.append(step.positions, position),
        slots=np.append(step.slots, slot),
        rows=np.append(step.rows, row),
        query_start=np.append(step.query_start, token + 1),
        context_lens=np.append(step.context_lens, context),
        logits_index=np.append(step.logits_index, token),
        width=step.width,
        num_prompt_rows=step.num_prompt_rows,
        state=state,
    )


class CompiledForward:
    """A `StepExecutor` for every step: `(input_ids [T], positions [T], slots [T], rows
    [B], query_start [B + 1], context_lens [B], logits_index [S]) -> logits [S, vocab]`
    through one compiled graph, over `pad_step`'s inputs. Block tables are read whole
    (every column) from the eager path's device tables by row, so their width is not a
    dimension of the graph. Call `warm_up` (which compiles or loads the graph) before the
    first step."""

    name = "compiled"

    def __init__(self, eager: EagerSteps) -> None:
        inductor_cache_dir()
        self._model = eager.model
        self._kv_caches = eager.kv_caches
        self._tables = eager.device_tables
        self._states = eager.states
        self._compiled: Any = None
        # Whether `warm_up` loaded a saved graph (True) or compiled one (False).
        self.loaded = False

    def host_inputs(self, step: StepInputs) -> tuple[np.ndarray, ...]:
        padding = -1 if self._states is None else self._states.padding_slot
        return pad_step(step, padding).arrays()

    def run(self, step: StepInputs, inputs: list[torch.Tensor]) -> torch.Tensor:
        logits = self._compiled(self._model, *inputs, **self._engine_tensors())
        return logits[: len(step.logits_index)]

    def _own_tensors(self) -> list[torch.Tensor]:
        """The engine's own tensors among `_engine_tensors`, each alone."""
        states = () if self._states is None else (self._states.conv, self._states.ssm)
        return [*self._kv_caches, self._tables, *(t for t in states if t is not None)]

    def _engine_tensors(self) -> dict[str, Any]:
        """What every step reads and writes of the engine's own, as `_step` takes them:
        the KV tensors, the block tables and a hybrid model's recurrent states (None
        without)."""
        states = self._states
        return {
            "kv_caches": self._kv_caches, "tables": self._tables,
            "conv": None if states is None else states.conv,
            "ssm": None if states is None else states.ssm,
        }  # fmt: skip

    def warm_up(self) -> float:
        """Load the saved graph, or compile and save it, then run one step of padding
        tokens through it (it writes no KV slot); return the seconds it took. Raises
        `ConfigError` if Inductor cannot build here (no C++ compiler, for one)."""
        started = time.perf_counter()
        folder = cache_root() / "compiled" / self.key()
        try:
            compiled = build_once(
                folder,
                self._compile_into,
                complete=lambda target: (target / GRAPH_FILE).is_file(),
                doing="compiling the forward",
                expected="about a minute, once per machine, model and settings",
                done="compiled the forward",
            )
            if compiled is None:
                compiled = self._load(folder)
                self.loaded = True
            self._compiled = compiled
            self._run_padding_step()  # with its guards: a graph that does not fit fails here
            compiled.disable_guard_check()  # see the docstring
        except Exception as exc:  # Inductor fails in many ways where it cannot build
            raise ConfigError(f"the forward cannot be compiled here: {exc}") from exc
        seconds = time.perf_counter() - started
        logger.info("compiled forward ready in %.1f s (%s)", seconds, folder)
        return seconds

    def key(self) -> str:
        """The hash of everything the compiled graph depends on (the module's docstring)."""
        digest = hashlib.sha256()
        for part in (
            FORMAT, torch.__version__, transformers.__version__, sys.version, cpu_flags(),
            self._model.config.to_json_string(), repr(self._model),
            str(self._model.dtype), str(_handles(self._model)),
            str([(t.dtype, tuple(t.shape)) for t in self._own_tensors()]),
        ):  # fmt: skip
            digest.update(part.encode() + b"\0")
        for source in _sources():
            digest.update(source.read_bytes() + b"\0")
        return digest.hexdigest()[:16]

    def _compile_into(self, folder: Path) -> Any:
        """Compile the graph over this engine's model and save it in `folder`."""
        # Static: Dynamo would give their sizes symbols shared with equal step sizes (the
        # K/V axis of 2 with a step's 2 sampled rows), specialized where they are indexed.
        for tensor in self._own_tensors():
            torch._dynamo.mark_static(tensor)
        compiler = torch.compile(
            _step,
            dynamic=True,
            fullgraph=True,
            options={
                # The guards a saved graph can carry: its tensor inputs' (see the docstring).
                "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe,
                # The graph's wrapper in C++ too (see the docstring).
                "cpp_wrapper": True,
                # Quantized linears that share an input run as one call.
                "post_grad_custom_pre_pass": GroupSharedInputs(),
            },
        )
        # Floats (norm epsilons, scales) as constants: tensorifying them would make
        # Dynamo restart its analysis, which a compile ahead of time cannot. Sizes of 1 as
        # any other (see the docstring).
        with (
            torch._dynamo.config.patch(specialize_float=True),
            torch.fx.experimental._config.patch(backed_size_oblivious=True),
            torch.inference_mode(),
        ):
            compiled = compiler.aot_compile((self._padding_inputs(), self._engine_tensors()))
        compiled.save_compiled_function(str(folder / GRAPH_FILE))
        return compiled

    def _load(self, folder: Path) -> Any:
        # The saved graph was built for this CPU's vector ISA (its flags are in the key):
        # Inductor need not compile and load a test program again to pick the ISA.
        with (
            torch._inductor.config.patch({"cpp.vec_isa_ok": True}),
            open(folder / GRAPH_FILE, "rb") as file,
        ):
            return torch.compiler.load_compiled_function(file)

    def _padding_inputs(self) -> tuple[Any, ...]:
        """A step of padding tokens, as the compiled function's positional arguments. Its sizes all
        differ (5 tokens, 3 sequences, 2 sampled, 6 checkpoints), because Dynamo gives
        equal sizes one symbol: a step with as many tokens as sequences would compile a
        graph for decode steps only."""
        lengths = np.array([1, 2, 2])
        starts = np.concatenate(([0], np.cumsum(lengths)))
        state: tuple[np.ndarray, ...] = ()
        if self._states is not None:  # every padding sequence in the padding slot
            padding = self._states.padding_slot
            # Six checkpoint entries: a size no other input has (see the docstring).
            state = (np.full(3, padding), np.full(3, -1), np.full(6, -1), np.full(6, padding))
        step = StepInputs(
            input_ids=np.zeros(starts[-1], dtype=np.int64),
            positions=np.concatenate([np.arange(n) for n in lengths]),
            slots=np.full(starts[-1], -1),
            rows=np.zeros(len(lengths), dtype=np.int64),
            query_start=starts,
            context_lens=lengths,
            logits_index=starts[1:3] - 1,
            width=1,
            state=state,
        )
        inputs = [torch.from_numpy(array.astype(np.int64)) for array in step.arrays()]
        return (self._model, *inputs)

    def _run_padding_step(self) -> None:
        with torch.inference_mode():
            self._compiled(*self._padding_inputs(), **self._engine_tensors())


def _step(
    model: PreTrainedModel,
    *arrays: torch.Tensor,
    kv_caches: tuple[torch.Tensor, ...],
    tables: torch.Tensor,
    conv: torch.Tensor | None,
    ssm: torch.Tensor | None,
) -> torch.Tensor:
    """The compiled function: a free function of its inputs, the model among them, so
    that a saved graph holds no reference to this process's objects. `arrays` are a step's
    (`StepInputs.arrays`, a hybrid model's four state arrays last); then the engine's own
    tensors: the KV tensors, the block tables, a hybrid model's recurrent states."""
    input_ids, positions, slots, rows, query_start, context_lens, logits_index, *state = arrays
    recurrent = None
    if conv is not None:
        recurrent = RecurrentStep(RecurrentStates(conv, ssm), query_start, *state, use_kernel=True)
    metadata = PagedAttentionMetadata.of_step(
        kv_caches, tables, slots, rows, query_start, context_lens, recurrent=recurrent
    )
    return model_logits(model, input_ids[None], positions[None], logits_index, metadata)


def _sources() -> list[Path]:
    """The sources a graph's code comes from: the model's (attention, kernels), the
    linears' and this folder's."""
    engine = Path(__file__).parents[1]
    folders = (engine / "model", engine / "linears", engine / "compiled")
    return sorted(
        path
        for folder in folders
        for path in folder.rglob("*")
        if path.suffix in (".py", ".cpp", ".h")
    )


def _handles(model: PreTrainedModel) -> list[int]:
    """The registry handles of the model's opaque linears: constants in the graph."""
    return [module.handle for module in model.modules() if isinstance(module, OpaqueLinear)]
