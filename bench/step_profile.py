"""Where one pagedserve decode step spends its time, at a few batch sizes.

`python -m bench.step_profile` fills the engine with B requests of `--context`-token
random prompts, steps until every request is decoding, then times `--steps` pure decode
steps (B rows of one token each) with stopwatches around `LLMEngine.step`, the model
runner's `execute` (input packing plus the model call), the model call itself, the paged
attention function (re-registered under its name with a timing wrapper) and the sampler.
Per step it reports, as medians over the timed steps:

- attention: paged attention summed over layers (writing the new K/V and attending);
- rest of the model: the model call minus attention (embeddings, projections, MLPs,
  norms, LM head);
- sampling: `Sampler.sample`;
- scheduling and input prep: the step minus the model call minus sampling; its input-prep
  part (packing ids, positions, slots, block tables) is also shown on its own;
- and, for comparison, the Hugging Face model's forward over the same B packed tokens with
  an attention function that returns zeros and its linear weights packed as the engine
  packs them: the engine's model without attention;
- ops: how many operators one decode step dispatches from Python (aten and pagedserve
  ops, counted by `torch.profiler` without the ops they call in turn). A compiled forward
  (`--set enforce_eager=false`) dispatches only its linears, K/V stores and attention
  calls: the rest runs inside Inductor's fused C++ loops. Attention is not timed apart
  there (it runs inside the compiled graph), so its column shows 0 and the model's whole
  time counts as the rest of the model.

Engine settings are pagedserve's defaults, changed with `--set KEY=VALUE`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench import throughput
from bench.tables import engine_setting, format_table, positive_ints
from bench.workloads import ordinary_token_ids, random_workload
from engine import LLM, SamplingParams
from engine.linears.packed_linear import can_pack, pack_linear_layers
from engine.llm_engine import LLMEngine
from engine.model.device import resolve_device, resolve_dtype
from engine.model.loader import load_model

logger = logging.getLogger("bench.step_profile")

NO_ATTENTION = "bench_no_attention"
# Decode steps run before timing, so the timed ones see warm shapes and allocator state.
WARMUP_STEPS = 2
# Requests never finish while being profiled; they are aborted afterwards.
MAX_TOKENS = 1024

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True)
class Stopwatch:
    """Accumulates the wall time spent inside the functions it wraps."""

    seconds: float = 0.0

    def wrap(self, fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += perf_counter() - start

        return timed  # type: ignore[return-value]


@dataclass(slots=True)
class StepTimes:
    """One decode step, in seconds: the step and the parts timed inside it."""

    step: float
    execute: float
    model: float
    attention: float
    sampling: float


@dataclass(slots=True)
class StepProfile:
    """Medians over the timed steps at one batch size, in milliseconds."""

    batch: int
    mean_context: float
    step_ms: float
    attention_ms: float
    rest_of_model_ms: float
    sampling_ms: float
    scheduling_and_input_ms: float
    input_prep_ms: float
    no_attention_forward_ms: float
    ops_per_step: int
    steps: list[StepTimes] = field(repr=False)


# -- the engine side --------------------------------------------------------------------


class InstrumentedEngine:
    """Stopwatches installed around one engine's step parts, reset before every step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.execute = Stopwatch()
        self.model = Stopwatch()
        self.attention = Stopwatch()
        self.sampling = Stopwatch()
        runner = engine.runner
        runner.execute = self.execute.wrap(runner.execute)  # type: ignore[method-assign]
        engine.sampler.sample = self.sampling.wrap(engine.sampler.sample)  # type: ignore[method-assign]
        self.attention_name = engine.model.config._attn_implementation
        self.attention_function = ALL_ATTENTION_FUNCTIONS[self.attention_name]
        if runner.executor.name == "compiled":
            # Compiled code calls neither the model object nor the attention function.
            runner.executor.run = self.model.wrap(runner.executor.run)  # type: ignore[method-assign]
            return
        runner.eager.model = self.model.wrap(runner.eager.model)
        # The model looks its attention function up by name on every call; wrap the one
        # this engine registered (a torch path or the C++ kernel's).
        AttentionInterface.register(
            self.attention_name, self.attention.wrap(self.attention_function)
        )

    def close(self) -> None:
        AttentionInterface.register(self.attention_name, self.attention_function)

    def ops_per_step(self) -> int:
        """Operators one engine step dispatches from Python (see the module docstring)."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            self.engine.step()
        return sum(
            1 for event in prof.events() if is_op(event.name) and not _has_op_ancestor(event)
        )

    def timed_step(self) -> StepTimes:
        for watch in (self.execute, self.model, self.attention, self.sampling):
            watch.seconds = 0.0
        start = perf_counter()
        self.engine.step()
        return StepTimes(
            perf_counter() - start,
            self.execute.seconds,
            self.model.seconds,
            self.attention.seconds,
            self.sampling.seconds,
        )


def is_op(name: str) -> bool:
    return name.startswith(("aten::", "pagedserve::", "mkldnn::"))


def _has_op_ancestor(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if is_op(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def fill_until_decoding(engine: LLMEngine, prompts: Sequence[list[int]], prefix: str) -> float:
    """Add one request per prompt, step until each has its first token; return the mean
    context length (prompt plus generated tokens) at that point."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    generated = {f"{prefix}-{i}": 0 for i in range(len(prompts))}
    for request_id, prompt in zip(generated, prompts, strict=True):
        engine.add_request(request_id, engine.processor.from_prompt(prompt, params))
    while min(generated.values()) == 0:
        for output in engine.step():
            generated[output.request_id] += len(output.outputs[0].token_ids)
    return statistics.mean(len(p) + generated[r] for r, p in zip(generated, prompts, strict=True))


def profile_engine(
    instrumented: InstrumentedEngine, prompts: Sequence[list[int]], steps: int, prefix: str
) -> tuple[float, list[StepTimes], int]:
    """Mean context when timing starts, the times of `steps` pure decode steps and the
    ops one more such step dispatches."""
    engine = instrumented.engine
    context = fill_until_decoding(engine, prompts, prefix)
    for _ in range(WARMUP_STEPS):
        engine.step()
    times = [instrumented.timed_step() for _ in range(steps)]
    ops = instrumented.ops_per_step()
    for i in range(len(prompts)):
        engine.abort_request(f"{prefix}-{i}")
    return context + WARMUP_STEPS, times, ops


# -- the model without attention ----------------------------------------------------------


def zero_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query `[1, H, T, D]` -> zeros `[1, T, H, D]`: attention that costs nothing."""
    batch, heads, tokens, head_dim = query.shape
    return query.new_zeros(batch, tokens, heads, head_dim), None


@torch.inference_mode()
def time_no_attention_forward(
    model: PreTrainedModel, batch: int, position: int, token_ids: Sequence[int], repeats: int
) -> float:
    """Median seconds of a forward over `batch` packed one-token sequences at `position`,
    with logits for every token (as a decode step computes them)."""
    generator = torch.Generator().manual_seed(0)
    pick = torch.randint(len(token_ids), (1, batch), generator=generator)
    input_ids = torch.as_tensor(token_ids)[pick].to(model.device)
    position_ids = torch.full((1, batch), position, dtype=torch.long, device=model.device)
    times = []
    for _ in range(WARMUP_STEPS + repeats):
        start = perf_counter()
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        times.append(perf_counter() - start)
    return statistics.median(times[WARMUP_STEPS:])


# -- the run ----------------------------------------------------------------------------


def summarize(
    batch: int, context: float, times: list[StepTimes], ops: int, no_attention: float
) -> StepProfile:
    def median_ms(part: Callable[[StepTimes], float]) -> float:
        return 1000 * statistics.median(part(t) for t in times)

    return StepProfile(
        batch=batch,
        mean_context=context,
        step_ms=median_ms(lambda t: t.step),
        attention_ms=median_ms(lambda t: t.attention),
        rest_of_model_ms=median_ms(lambda t: t.model - t.attention),
        sampling_ms=median_ms(lambda t: t.sampling),
        scheduling_and_input_ms=median_ms(lambda t: t.step - t.model - t.sampling),
        input_prep_ms=median_ms(lambda t: t.execute - t.model),
        no_attention_forward_ms=1000 * no_attention,
        ops_per_step=ops,
        steps=times,
    )


def run(args: argparse.Namespace) -> list[StepProfile]:
    """Profile every batch size with one engine, then the model without attention."""
    device = resolve_device("auto")
    dtype = resolve_dtype(args.dtype, device)
    llm = LLM(
        args.model,
        **(
            dict(
                dtype=str(dtype).removeprefix("torch."),
                device=device.type,
                kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=max(args.batch_sizes),
            )
            | dict(args.set)
        ),
    )
    tokenizer = llm.get_tokenizer()
    excluded = {*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder}
    token_ids = ordinary_token_ids(len(tokenizer), excluded)
    instrumented = InstrumentedEngine(llm.engine)
    measured = []
    try:
        for batch in args.batch_sizes:
            logger.info("profiling decode at batch %d", batch)
            prompts = random_workload(batch, args.context, args.context, 1, token_ids).prompts
            context, times, ops = profile_engine(instrumented, prompts, args.steps, f"b{batch}")
            measured.append((batch, context, times, ops))
    finally:
        instrumented.close()
    del llm, instrumented
    AttentionInterface.register(NO_ATTENTION, zero_attention)
    plain = load_model(args.model, dtype=dtype, device=device, attn_implementation=NO_ATTENTION)
    if can_pack(device, dtype):  # the engine's weight layout, so only attention differs
        pack_linear_layers(plain.model)
    return [
        summarize(
            batch,
            context,
            times,
            ops,
            time_no_attention_forward(plain.model, batch, round(context), token_ids, args.steps),
        )
        for batch, context, times, ops in measured
    ]


def report(profiles: Sequence[StepProfile]) -> str:
    headers = [
        "batch", "context", "step ms", "attention ms", "rest of model ms", "sampling ms",
        "sched+input ms", "(input prep ms)", "HF no-attn fwd ms", "attention share", "ops",
    ]  # fmt: skip
    rows = [
        [
            str(p.batch),
            f"{p.mean_context:.0f}",
            f"{p.step_ms:.1f}",
            f"{p.attention_ms:.1f}",
            f"{p.rest_of_model_ms:.1f}",
            f"{p.sampling_ms:.1f}",
            f"{p.scheduling_and_input_ms:.1f}",
            f"{p.input_prep_ms:.1f}",
            f"{p.no_attention_forward_ms:.1f}",
            f"{p.attention_ms / p.step_ms:.0%}",
            str(p.ops_per_step),
        ]
        for p in profiles
    ]
    return format_table(headers, rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.step_profile",
        description="Split one pagedserve decode step into attention, the rest of the model, "
        "sampling and scheduling/input preparation (medians).",
    )
    parser.add_argument(
        "--batch-sizes", type=positive_ints, default=[32, 128], help="comma list (32,128)"
    )
    parser.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per batch")
    parser.add_argument("--model", default="default", help="pagedserve's model setting")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
        help="compute dtype; auto is pagedserve's choice for this device",
    )  # fmt: skip
    parser.add_argument("--kv-cache-memory", default="2GiB", help="pagedserve's KV cache")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--set", type=engine_setting, action="append", default=[], metavar="KEY=VALUE",
        help="an engine setting, e.g. enforce_eager=false or quantization=int8; repeatable",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    throughput.configure_logging()
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    profiles = run(args)
    print(report(profiles))
    if args.json is not None:
        rows = [asdict(profile) for profile in profiles]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
