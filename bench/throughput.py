"""Offline throughput: pagedserve against transformers' own generation, in one run.

`python -m bench.throughput` runs one fixed workload of random prompts, greedy and ignoring
end of sequence, through pagedserve, through transformers' continuous batching
(`generate_batch`) and through plain `generate` in static left-padded batches, all in the
same dtype with the same prompts, and prints a table with each engine's output throughput
as a ratio to `generate_batch`. `--workload` picks the preset: w1 (64 requests, prompts of
64-256 tokens, 128 output tokens each), w2 (512 requests, 128-512, 256 each, at most 256
sequences in a batch) or nano (nano-vllm's bench.py: 256 requests, prompt and output
lengths each uniform in 100-1024, at most 256 sequences). Flags given override the preset.

Requests whose output lengths differ reach `generate_batch`'s engine through its manager's
`add_request` (`generate_batch` itself takes one `max_new_tokens`), and plain `generate`
stops each row of a static batch at its own length while the batch runs until its longest
row is done; the report says so next to those engines.

`--workload shared-prefix` runs a long common system prompt followed by short distinct
questions through pagedserve twice, with prefix caching on and off, and compares time to
first token (TTFT). Every request arrives at once, so TTFT includes queueing behind the
other requests' prefills.

Each engine first runs a small warm-up batch that is not timed; model loading and KV-cache
allocation are not timed either. On a machine other processes keep busy, `--threads 1`
keeps torch's threads from waiting on each other, which can slow every engine many times.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.continuous_batching.requests import GenerationOutput

from bench.tables import engine_setting, format_table
from bench.workloads import Workload, ordinary_token_ids, random_workload, shared_prefix_workload
from engine import LLM, SamplingParams
from engine.config import EngineConfig, load_config
from engine.model.device import resolve_device, resolve_dtype
from engine.model.kv_cache import KVLayout
from engine.model.loader import LoadedModel, load_model, resolve_model_folder
from engine.sampling.params import StructuredOutputs

logger = logging.getLogger("bench.throughput")

ENGINES = ("pagedserve", "generate_batch", "generate")
BASELINE = "generate_batch"
# The attention transformers' peers run with: SDPA works on the CPU for both generate and
# generate_batch ("paged|sdpa" is an alias of it for continuous batching).
PEER_ATTENTION = "sdpa"
# Tokens per page of transformers' continuous-batching cache (its default).
CB_PAGE_SIZE = 256
WARMUP_SEED = 1
# Per workload, the defaults of the flags left unset on the command line; then FALLBACKS.
DEFAULTS: dict[str, dict[str, int]] = {
    "w1": {"num_requests": 64, "min_prompt": 64, "max_prompt": 256, "output_len": 128},
    "w2": {
        "num_requests": 512, "min_prompt": 128, "max_prompt": 512, "output_len": 256,
        "max_num_seqs": 256,
    },
    "nano": {
        "num_requests": 256, "min_prompt": 100, "max_prompt": 1024, "output_len": 100,
        "max_output_len": 1024, "max_num_seqs": 256,
    },
    "shared-prefix": {"num_requests": 32, "prefix_len": 1000, "tail_len": 32, "output_len": 64},
}  # fmt: skip
FALLBACKS = {"max_num_seqs": EngineConfig.model_fields["max_num_seqs"].default}


@dataclass(slots=True)
class RunResult:
    """One timed run of one engine over a whole workload.

    The TTFT and cache fields are pagedserve's only (None for transformers' peers); `note`
    says how an engine ran a workload its usual call cannot express (None: the usual way).
    """

    engine: str
    requests: int
    output_tokens: int
    seconds: float
    ttft_mean_ms: float | None = None
    ttft_median_ms: float | None = None
    cached_prompt_tokens: int | None = None
    preemptions: int | None = None
    note: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


# -- engines ------------------------------------------------------------------------------


def run_pagedserve(
    config: EngineConfig,
    workload: Workload,
    warmup: Workload,
    label: str,
    structured: StructuredOutputs | None = None,
) -> RunResult:
    """Build an LLM from `config`, warm it up, then time `generate` over the workload
    (every request constrained by `structured`, if given)."""
    llm = LLM(**config.model_dump())
    llm.generate(warmup.prompts, _greedy_params(warmup, structured), use_tqdm=False)
    preemptions_before = llm.engine.stats().num_preemptions
    start = perf_counter()
    params = _greedy_params(workload, structured)
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = perf_counter() - start
    failed = [output.error for output in outputs if output.error is not None]
    if failed:
        raise RuntimeError(f"pagedserve failed {len(failed)} requests, e.g. {failed[0]}")
    ttfts = [
        output.metrics.first_token_time - output.metrics.arrival_time
        for output in outputs
        if output.metrics.first_token_time is not None
    ]
    return RunResult(
        engine=label,
        requests=len(outputs),
        output_tokens=sum(len(output.outputs[0].token_ids) for output in outputs),
        seconds=seconds,
        ttft_mean_ms=1000 * statistics.mean(ttfts),
        ttft_median_ms=1000 * statistics.median(ttfts),
        cached_prompt_tokens=sum(output.num_cached_tokens for output in outputs),
        preemptions=llm.engine.stats().num_preemptions - preemptions_before,
    )


def _greedy_params(
    workload: Workload, structured: StructuredOutputs | None = None
) -> list[SamplingParams]:
    """One per request, each generating exactly its request's output length."""
    return [
        SamplingParams(
            max_tokens=length, temperature=0.0, ignore_eos=True, structured_outputs=structured
        )
        for length in workload.output_lens
    ]


def run_generate_batch(
    loaded: LoadedModel, config: EngineConfig, workload: Workload, warmup: Workload
) -> RunResult:
    """transformers' continuous batching with pagedserve's batch budgets and KV-cache size.

    The manager (its cache allocation and set-up) is made by the warm-up call and kept for
    the timed one, as pagedserve's engine is built before its timed run. A workload whose
    output lengths differ goes to that manager directly (see `_generate_per_request`).
    """
    # EOS id -1 disables end-of-sequence, so every request runs to max_new_tokens.
    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1)
    cb_config = _cb_config(loaded.model, config)

    def generate(batch: Workload) -> int:
        if batch.output_len is None:
            outputs = _generate_per_request(loaded.model, batch, generation_config, cb_config)
        else:
            outputs = loaded.model.generate_batch(
                inputs=batch.prompts,
                generation_config=generation_config,
                continuous_batching_config=cb_config,
                persistent_manager=True,
                max_new_tokens=batch.output_len,
            )
        failed = [output for output in outputs.values() if output.error is not None]
        if len(outputs) != batch.num_requests or failed:
            raise RuntimeError(
                f"generate_batch returned {len(outputs)} of {batch.num_requests} requests, "
                f"{len(failed)} failed"
            )
        return sum(len(output.generated_tokens) for output in outputs.values())

    try:
        generate(warmup)
        result = _timed(BASELINE, workload, lambda: generate(workload))
    finally:
        loaded.model.destroy_cached_continuous_batching_manager()
    if workload.output_len is None:
        result.note = (
            "per-request lengths through generate_batch's ContinuousBatchingManager.add_request "
            "(generate_batch takes one max_new_tokens)"
        )
    return result


def _generate_per_request(
    model: PreTrainedModel,
    batch: Workload,
    generation_config: GenerationConfig,
    cb_config: ContinuousBatchingConfig,
) -> dict[str, GenerationOutput]:
    """`generate_batch`'s own steps (its manager, every request added at once, results
    collected until all are finished) with one `max_new_tokens` per request."""
    results: dict[str, GenerationOutput] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config,
        block=True, timeout=5, persistent_manager=True,
    ) as manager:  # fmt: skip
        for prompt, length in zip(batch.prompts, batch.output_lens, strict=True):
            manager.add_request(prompt, max_new_tokens=length)
        while len(results) < batch.num_requests:
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                break  # check_complete reports the missing requests
            if result is not None and result.is_finished():
                results[result.request_id] = result
    return results


def _cb_config(model: PreTrainedModel, config: EngineConfig) -> ContinuousBatchingConfig:
    """Budgets as pagedserve's; the cache as large as pagedserve's `kv_cache_memory` (when
    set), instead of a share of all free memory."""
    num_blocks = None
    if config.kv_cache_memory is not None:
        layout = KVLayout.from_config(model.config)
        page_bytes = layout.bytes_per_block(CB_PAGE_SIZE, model.dtype.itemsize)
        num_blocks = int(config.kv_cache_memory) // page_bytes
    return ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=config.max_num_batched_tokens,
        max_requests_per_batch=config.max_num_seqs,
    )


def run_generate(
    loaded: LoadedModel, workload: Workload, warmup: Workload, batch_size: int
) -> RunResult:
    """Plain `generate` over consecutive static batches of `batch_size` left-padded prompts;
    each row stops at its request's output length, each batch at its longest row's."""
    pad_id = loaded.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = min(loaded.eos_token_ids)

    def generate(batch: Workload) -> int:
        generated = 0
        for start in range(0, batch.num_requests, batch_size):
            lengths = batch.output_lens[start : start + batch_size]
            input_ids, attention_mask = left_pad(
                batch.prompts[start : start + batch_size], pad_id, loaded.model.device
            )
            # min_new_tokens = max_new_tokens masks EOS, so every row runs to its length.
            generation_config = GenerationConfig(
                max_new_tokens=max(lengths),
                min_new_tokens=max(lengths),
                do_sample=False,
                eos_token_id=sorted(loaded.eos_token_ids),
                pad_token_id=pad_id,
            )
            output = loaded.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=generation_config,
                stopping_criteria=StoppingCriteriaList([RowLengths(input_ids, lengths)]),
            )
            steps = output.shape[1] - input_ids.shape[1]
            generated += sum(min(length, steps) for length in lengths)
        return generated

    generate(warmup)
    result = _timed(f"generate (batch {batch_size})", workload, lambda: generate(workload))
    if workload.output_len is None:
        result.note = "rows stop at their own lengths; a static batch runs until its longest"
    return result


class RowLengths(StoppingCriteria):
    """Stops row `i` of a batch once it has generated `lengths[i]` tokens after the (padded)
    prompt columns of `prompt_ids`; `generate` pads stopped rows until every row stopped."""

    def __init__(self, prompt_ids: torch.Tensor, lengths: Sequence[int]) -> None:
        self.prompt_width = prompt_ids.shape[1]
        self.lengths = torch.tensor(lengths, device=prompt_ids.device)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return input_ids.shape[1] - self.prompt_width >= self.lengths


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` `[len(prompts), longest]`, padded on the left."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _timed(engine: str, workload: Workload, generate: Callable[[], int]) -> RunResult:
    start = perf_counter()
    tokens = generate()
    return RunResult(engine, workload.num_requests, tokens, perf_counter() - start)


def load_peer_model(config: EngineConfig) -> LoadedModel:
    """The same model, in the same dtype and on the same device, for transformers' peers."""
    device = resolve_device(config.device)
    return load_model(
        config.model,
        dtype=resolve_dtype(config.dtype, device),
        device=device,
        attn_implementation=PEER_ATTENTION,
    )


# The schema of `--json-schema`: at least 64 records, more than any output of these
# workloads can hold, so a constrained request runs its whole length like an unconstrained one.
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "name", "tags"],
            },
        }
    },
    "required": ["records"],
}


# -- workloads and runs ---------------------------------------------------------------


def build_config(args: argparse.Namespace) -> EngineConfig:
    """pagedserve's settings, with `auto` dtype resolved so that every engine shares it."""
    device = resolve_device("auto")
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    return load_config(
        EngineConfig,
        overrides={
            "model": args.model,
            "dtype": dtype,
            "device": device.type,
            "kv_cache_memory": args.kv_cache_memory,
            "max_num_seqs": args.max_num_seqs,
            **dict(args.set),
        },
        environ={},
    )


def build_workloads(args: argparse.Namespace) -> tuple[Workload, Workload]:
    """The workload the flags describe and a small warm-up workload, disjoint from it."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_folder(args.model)[0])
    excluded = {*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder}
    token_ids = ordinary_token_ids(len(tokenizer), excluded)
    warmup = random_workload(4, 16, 32, 4, token_ids, seed=WARMUP_SEED)
    if args.workload == "shared-prefix":
        workload = shared_prefix_workload(
            args.num_requests, args.prefix_len, args.tail_len, args.output_len, token_ids, args.seed
        )
    else:
        workload = random_workload(
            args.num_requests, args.min_prompt, args.max_prompt, args.output_len, token_ids,
            args.seed, args.max_output_len,
        )  # fmt: skip
    return workload, warmup


def run_engines(
    args: argparse.Namespace, config: EngineConfig, workload: Workload, warmup: Workload
) -> list[RunResult]:
    """Every engine asked for, pagedserve first; one peer model serves both HF engines."""
    results = []
    if "pagedserve" in args.engines:
        logger.info("running pagedserve")
        results.append(run_pagedserve(config, workload, warmup, "pagedserve"))
        gc.collect()
        if args.json_schema:
            label = "pagedserve (JSON schema)"
            logger.info("running %s", label)
            schema = StructuredOutputs(json=RECORDS_SCHEMA)
            results.append(run_pagedserve(config, workload, warmup, label, schema))
            gc.collect()
    peers = [engine for engine in args.engines if engine != "pagedserve"]
    if peers:
        loaded = load_peer_model(config)
        for engine in peers:
            logger.info("running %s", engine)
            if engine == BASELINE:
                results.append(run_generate_batch(loaded, config, workload, warmup))
            else:
                results.append(run_generate(loaded, workload, warmup, args.generate_batch_size))
    for result in results:
        check_complete(result, workload)
    return results


def run_shared_prefix(
    config: EngineConfig, workload: Workload, warmup: Workload
) -> list[RunResult]:
    """pagedserve with prefix caching on, then off, over the same prompts."""
    results = []
    for enabled in (True, False):
        label = f"pagedserve (prefix cache {'on' if enabled else 'off'})"
        logger.info("running %s", label)
        settings = config.model_copy(update={"enable_prefix_caching": enabled})
        results.append(run_pagedserve(settings, workload, warmup, label))
        gc.collect()
    for result in results:
        check_complete(result, workload)
    return results


def check_complete(result: RunResult, workload: Workload) -> None:
    """Every engine must have generated the whole workload, or the comparison is unfair."""
    if result.output_tokens != workload.num_output_tokens:
        raise RuntimeError(
            f"{result.engine} generated {result.output_tokens} tokens, "
            f"expected {workload.num_output_tokens}"
        )


# -- reporting ------------------------------------------------------------------------


def throughput_ratios(results: Sequence[RunResult]) -> dict[str, float]:
    """Each engine's output tok/s divided by generate_batch's (empty when it did not run)."""
    baseline = next((r for r in results if r.engine == BASELINE), None)
    if baseline is None:
        return {}
    return {r.engine: r.tokens_per_second / baseline.tokens_per_second for r in results}


def prefix_ratios(results: Sequence[RunResult]) -> dict[str, float]:
    """Caching off over on for TTFT (higher: caching helps more); on over off for tok/s."""
    on, off = results
    return {
        "ttft_mean_off_over_on": _ratio(off.ttft_mean_ms, on.ttft_mean_ms),
        "ttft_median_off_over_on": _ratio(off.ttft_median_ms, on.ttft_median_ms),
        "throughput_on_over_off": on.tokens_per_second / off.tokens_per_second,
    }


def _ratio(numerator: float | None, denominator: float | None) -> float:
    if numerator is None or denominator is None:
        raise ValueError("a TTFT ratio needs pagedserve's TTFT on both sides")
    return numerator / denominator


# The columns every report starts with, and their cells for one run.
RUN_HEADERS = ["engine", "requests", "output tokens", "time s", "output tok/s"]


def _run_cells(r: RunResult) -> list[str]:
    return [
        r.engine, str(r.requests), str(r.output_tokens), f"{r.seconds:.1f}",
        f"{r.tokens_per_second:.1f}",
    ]  # fmt: skip


def engines_report(results: Sequence[RunResult], ratios: dict[str, float]) -> str:
    headers = [*RUN_HEADERS, f"vs {BASELINE}"]
    rows = [
        [*_run_cells(r), f"{ratios[r.engine]:.2f}x" if r.engine in ratios else "-"] for r in results
    ]
    lines = [format_table(headers, rows)]
    lines += [
        f"{engine} / {BASELINE}: {ratio:.2f}x"
        for engine, ratio in ratios.items()
        if engine != BASELINE
    ]
    lines += [f"note, {r.engine}: {r.note}" for r in results if r.note is not None]
    return "\n".join(lines)


def shared_prefix_report(results: Sequence[RunResult], ratios: dict[str, float]) -> str:
    headers = [*RUN_HEADERS, "TTFT mean ms", "TTFT median ms", "cached prompt tokens"]
    rows = [
        [
            *_run_cells(r), f"{r.ttft_mean_ms:.0f}", f"{r.ttft_median_ms:.0f}",
            str(r.cached_prompt_tokens),
        ]
        for r in results
    ]  # fmt: skip
    return "\n".join(
        [
            format_table(headers, rows),
            f"TTFT off / on: mean {ratios['ttft_mean_off_over_on']:.2f}x, "
            f"median {ratios['ttft_median_off_over_on']:.2f}x",
            f"output tok/s on / off: {ratios['throughput_on_over_off']:.2f}x",
            "(all requests arrive at once: TTFT includes queueing behind other prefills)",
        ]
    )


def write_json(
    path: Path,
    preset: str,
    config: EngineConfig,
    workload: Workload,
    results: Sequence[RunResult],
    ratios: dict[str, float],
) -> None:
    """`output_len` is None when the requests' output lengths differ."""
    report: dict[str, Any] = {
        "workload": {
            "name": workload.name,
            "preset": preset,
            "requests": workload.num_requests,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_len": workload.output_len,
            "min_output_len": min(workload.output_lens),
            "max_output_len": max(workload.output_lens),
            "output_tokens": workload.num_output_tokens,
        },
        "config": config.model_dump(mode="json"),
        "peer_attention": PEER_ATTENTION,
        "threads": torch.get_num_threads(),
        "results": [asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in results],
        "ratios": ratios,
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


# -- command line ---------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description="Offline output throughput of pagedserve against transformers' peers.",
    )
    parser.add_argument(
        "--workload", choices=sorted(DEFAULTS), default="w1",
        help="w1, w2, nano: random prompts through every engine (default: w1); shared-prefix: "
        "a long common prefix through pagedserve with prefix caching on and off",
    )  # fmt: skip
    parser.add_argument("--model", default="default", help="pagedserve's model setting")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
        help="compute dtype of every engine; auto is pagedserve's choice for this device",
    )  # fmt: skip
    parser.add_argument(
        "--engines", type=_engine_list, default=list(ENGINES),
        help=f"comma list of {','.join(ENGINES)} (not shared-prefix)",
    )  # fmt: skip
    parser.add_argument("--num-requests", type=int, help="w1: 64; w2: 512; nano: 256; prefix: 32")
    parser.add_argument("--min-prompt", type=int, help="shortest prompt, tokens (w1: 64)")
    parser.add_argument("--max-prompt", type=int, help="longest prompt, tokens (w1: 256)")
    parser.add_argument("--prefix-len", type=int, help="shared-prefix: common prefix (1000)")
    parser.add_argument("--tail-len", type=int, help="shared-prefix: distinct tail (32)")
    parser.add_argument(
        "--output-len", type=int,
        help="tokens every request generates (w1: 128; w2: 256; shared-prefix: 64), or with "
        "--max-output-len the fewest (nano: 100)",
    )  # fmt: skip
    parser.add_argument(
        "--max-output-len", type=int,
        help="the most output tokens: each request's length is uniform in [output-len, "
        "max-output-len] (nano: 1024; the others: unset, every request generates output-len)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument(
        "--generate-batch-size", type=int, default=16, help="static batch size of plain generate"
    )
    parser.add_argument(
        "--kv-cache-memory", default="2GiB",
        help="pagedserve's KV cache (generate_batch gets the same), e.g. 2GiB",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-seqs", type=int,
        help="sequences in one batch, pagedserve's and generate_batch's (w2, nano: 256; the "
        f"others: {FALLBACKS['max_num_seqs']})",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads for every engine (default: torch's)"
    )
    parser.add_argument(
        "--json-schema", action="store_true",
        help="also run pagedserve with every request constrained by a JSON schema (structured "
        "outputs) that no output of the workload's lengths can complete",
    )  # fmt: skip
    parser.add_argument(
        "--set", type=engine_setting, action="append", default=[], metavar="KEY=VALUE",
        help="a pagedserve engine setting, repeatable: e.g. --set attention_backend=triton "
        "--set enforce_eager=false --set max_num_batched_tokens=4096",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    for key, value in {**FALLBACKS, **DEFAULTS[args.workload]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_output_len is not None and args.workload == "shared-prefix":
        parser.error("--max-output-len does not apply to shared-prefix")
    if args.max_output_len is not None and args.max_output_len < args.output_len:
        parser.error("--max-output-len must be at least --output-len")
    return args


def configure_logging() -> None:
    """Progress from the benchmark and the engine; only warnings from libraries."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("bench", "engine"):
        logging.getLogger(name).setLevel(logging.INFO)


def _engine_list(text: str) -> list[str]:
    engines = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise argparse.ArgumentTypeError(f"choose from {','.join(ENGINES)}, got {text!r}")
    return [engine for engine in ENGINES if engine in engines]


def main(argv: Sequence[str] | None = None) -> None:
    configure_logging()
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = build_config(args)
    workload, warmup = build_workloads(args)
    logger.info(
        "%s: %d requests, %d prompt tokens, %d output tokens (%d-%d a request); %s on %s",
        args.workload, workload.num_requests, workload.num_prompt_tokens,
        workload.num_output_tokens, min(workload.output_lens), max(workload.output_lens),
        config.dtype, config.device,
    )  # fmt: skip
    if args.workload == "shared-prefix":
        results = run_shared_prefix(config, workload, warmup)
        ratios = prefix_ratios(results)
        print(shared_prefix_report(results, ratios))
    else:
        results = run_engines(args, config, workload, warmup)
        ratios = throughput_ratios(results)
        print(engines_report(results, ratios))
    if args.json is not None:
        write_json(args.json, args.workload, config, workload, results, ratios)


if __name__ == "__main__":
    main()
