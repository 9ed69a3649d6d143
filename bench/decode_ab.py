"""Decode-step time of several engine settings, interleaved in one process.

`python -m bench.decode_ab --variant eager= --variant compiled=enforce_eager=false` builds
one engine per variant (pagedserve's defaults plus the variant's comma-separated
KEY=VALUE settings), fills each with B requests of `--context`-token prompts until all
are decoding, then times `--rounds` rounds in which every engine takes one decode step
in turn. Taking turns step by step, in one process, keeps the machine's drift (other
work, clock, memory state) out of the comparison, which runs minutes apart do not. It
prints each variant's median step time at each batch size and its ratio to the first
variant's.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from time import perf_counter

import torch

from bench import throughput
from bench.step_profile import fill_until_decoding
from bench.tables import engine_setting, format_table, positive_ints
from bench.workloads import ordinary_token_ids, random_workload
from engine import LLM


def variant(text: str) -> tuple[str, dict[str, str]]:
    """An argparse type: NAME=KEY=VALUE,KEY=VALUE (or NAME= for the defaults)."""
    name, sep, settings = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=SETTINGS, got {text!r}")
    pairs = [engine_setting(item) for item in settings.split(",") if item.strip()]
    return name.strip(), dict(pairs)


def run(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Median step seconds per batch size and variant."""
    base = {"model": args.model, "kv_cache_memory": args.kv_cache_memory}
    base["max_num_seqs"] = str(max(args.batch_sizes))
    engines = {name: LLM(**(base | settings)).engine for name, settings in args.variant}
    first = next(iter(engines.values()))
    tokenizer = first.tokenizer
    excluded = {*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder}
    token_ids = ordinary_token_ids(len(tokenizer), excluded)
    medians: dict[int, dict[str, float]] = {}
    for batch in args.batch_sizes:
        prompts = random_workload(batch, args.context, args.context, 1, token_ids).prompts
        for engine in engines.values():
            fill_until_decoding(engine, prompts, f"b{batch}")
            engine.step()  # a warm-up decode step
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                start = perf_counter()
                engine.step()
                times[name].append(perf_counter() - start)
        for engine in engines.values():
            for i in range(batch):
                engine.abort_request(f"b{batch}-{i}")
        medians[batch] = {name: statistics.median(t) for name, t in times.items()}
    return medians


def report(medians: dict[int, dict[str, float]]) -> str:
    rows = []
    for batch, by_name in medians.items():
        baseline = next(iter(by_name.values()))
        for name, seconds in by_name.items():
            rows.append([name, str(batch), f"{seconds * 1000:.1f}", f"{baseline / seconds:.2f}x"])
    return format_table(["variant", "batch", "step ms (median)", "speed vs first"], rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decode_ab",
        description="Median decode-step time of engine settings, taking turns step by step.",
    )
    parser.add_argument(
        "--variant", type=variant, action="append", required=True, metavar="NAME=SETTINGS",
        help="e.g. 'int8=quantization=int8' or 'both=enforce_eager=false,quantization=int8'",
    )  # fmt: skip
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 8], help="e.g. 1,8")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per engine")
    parser.add_argument("--model", default="default", help="pagedserve's model setting")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="each engine's KV cache")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"--variant names must differ: {names}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    throughput.configure_logging()
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(report(run(args)))


if __name__ == "__main__":
    main()
