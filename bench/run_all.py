"""`make bench`: offline throughput, then the same model served over HTTP, side by side.

Runs `python -m bench.throughput` (with its defaults, or `--throughput-args`), then
pagedserve alone on the same workload with `--max-num-seqs` set to the highest serving
concurrency, then starts `pagedserve serve --config CONFIG` on a free loopback port, runs
`python -m bench.serve` against it at concurrency 1, 8 and 32 with the offline run's output
length and about its prompt length (one random word is about one token), and stops the
server. With `--serve-variant NAME=FLAGS` (repeatable) it serves once per variant, each
started with those extra flags (e.g. `int8=--quantization int8`), and with `--llama-server
BINARY` (or `$LLAMA_SERVER`) it then measures llama.cpp's server on the default model's
GGUF the same way, and adds a table of the servers side by side. Prints the tables and
the serving output throughput at the highest concurrency next to the offline figures;
the HTTP overhead is taken against the offline run with as many sequences in a batch as
the first server had in flight. The runs take turns, so they
never share the CPU. Reports, the server log and the plot go to `--out`.

`--suite gpu` (on a CUDA machine only; it refuses to start without one) runs, in bf16,
`bench.throughput` with each of the presets w1, w2 and nano through pagedserve and
transformers' `generate_batch`, then the server (`--config`, default configs/cuda.yaml)
at concurrency 1, 8, 32 and 128 with W1's output length and about its prompt length. In
both suites `--model` replaces every run's model, `--throughput-args` come after the
suite's own flags (so they override them), and the printed tables also go to
`--out`/tables.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.llama_server import start_llama_server
from bench.tables import format_table, free_port, positive_ints

READY_TIMEOUT = 600.0  # the first start converts the default model
STOP_TIMEOUT = 60.0
# Per suite, the defaults of the flags left unset on the command line.
SUITES: dict[str, dict[str, Any]] = {
    "default": {"config": Path("configs/default.yaml"), "concurrency": [1, 8, 32]},
    "gpu": {"config": Path("configs/cuda.yaml"), "concurrency": [1, 8, 32, 128]},
}
GPU_WORKLOADS = ("w1", "w2", "nano")
# The pagedserve server measured when no --serve-variant is given: the config as it is.
DEFAULT_VARIANT: tuple[str, list[str]] = ("pagedserve", [])
# 32GiB: the KV cache each engine got in the GPU kit's W2 and nano runs (--throughput-args
# overrides it, e.g. for a model whose 256 sequences of 2,048 tokens need more).
GPU_THROUGHPUT_FLAGS = (
    "--dtype=bfloat16", "--kv-cache-memory=32GiB", "--engines=pagedserve,generate_batch",
)  # fmt: skip


def serve_variant(text: str) -> tuple[str, list[str]]:
    """An argparse type: 'NAME=FLAGS' -> (NAME, the flags split as a shell would)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {text!r}")
    return name.strip(), shlex.split(flags)


def run_module(module: str, *args: str) -> str:
    """Run `python -m module args`, its log passing through; return its stdout."""
    command = [sys.executable, "-m", module, *args]
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    return subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout


def start_server(
    config: Path, port: int, log: Path, model: str | None = None, flags: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """`pagedserve serve` on 127.0.0.1:`port` (with `model` instead of the config's when
    given, then `flags`), returned once /health answers 200."""
    command = [sys.executable, "-m", "pagedserve", "serve", "--config", str(config)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += [] if model is None else ["--model", model]
    command += flags
    print(f"$ {' '.join(command)} > {log} 2>&1", file=sys.stderr, flush=True)
    with log.open("wb") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    return wait_healthy(server, port, log)


def wait_healthy(server: subprocess.Popen[bytes], port: int, log: Path) -> subprocess.Popen[bytes]:
    """`server` once its /health answers 200; stopped, and the run ended, if it exits or
    takes longer than READY_TIMEOUT."""
    deadline = time.monotonic() + READY_TIMEOUT
    while not _healthy(f"http://127.0.0.1:{port}/health"):
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"bench.run_all: the server did not become healthy:\n{tail}")
        time.sleep(0.5)
    return server


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """Ctrl-C (a graceful shutdown), then a kill if that takes too long."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def offline_throughput(report: dict[str, Any]) -> float:
    """pagedserve's output tok/s in a `bench.throughput --json` report."""
    return next(
        float(r["tokens_per_second"]) for r in report["results"] if r["engine"] == "pagedserve"
    )


def comparison(offline: dict[str, Any], matched: dict[str, Any], serving: dict[str, Any]) -> str:
    """Serving output tok/s at the highest concurrency against both offline runs; the
    overhead is taken against `matched`, the offline run with that many sequences at most."""
    level = max(serving["levels"], key=lambda entry: entry["concurrency"])
    offline_tps = offline_throughput(offline)
    matched_tps = offline_throughput(matched)
    serving_tps = level["output_throughput"]
    overhead = 100.0 * (1.0 - serving_tps / matched_tps)
    requests = offline["workload"]["requests"]
    return "\n".join(
        [
            f"offline (bench.throughput, {requests} requests, at most "
            f"{offline['config']['max_num_seqs']} in a batch): {offline_tps:.1f} output tok/s",
            f"offline (the same, at most {matched['config']['max_num_seqs']} in a batch): "
            f"{matched_tps:.1f} output tok/s",
            f"served over HTTP (bench.serve, concurrency {level['concurrency']}, "
            f"{level['successes']}/{level['requests']} ok): {serving_tps:.1f} output tok/s",
            f"HTTP serving overhead at matched concurrency: {overhead:.1f}% "
            f"(served / offline = {serving_tps / matched_tps:.2f}x)",
        ]
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run_all",
        description="Offline throughput and HTTP serving benchmarks of pagedserve, compared.",
    )
    parser.add_argument(
        "--suite", choices=sorted(SUITES), default="default",
        help="default: one offline workload, then the server; gpu: w1, w2 and nano against "
        "generate_batch, then the server (CUDA only)",
    )  # fmt: skip
    parser.add_argument("--model", help="every run's model (default: each tool's own)")
    parser.add_argument(
        "--config", type=Path, help="the server's settings (configs/default.yaml; gpu: cuda.yaml)"
    )
    parser.add_argument(
        "--concurrency", type=positive_ints, help="bench.serve's levels (1,8,32; gpu: 1,8,32,128)"
    )
    parser.add_argument(
        "--throughput-args",
        type=shlex.split,
        default=[],
        help="extra bench.throughput flags, e.g. '--engines pagedserve --num-requests 16'",
    )
    parser.add_argument(
        "--serve-variant", type=serve_variant, action="append", metavar="NAME=FLAGS",
        help="a pagedserve server to measure, started with these extra `pagedserve serve` "
        "flags (e.g. 'int8=--quantization int8'); repeatable; default: one, with none",
    )  # fmt: skip
    parser.add_argument(
        "--llama-server", type=Path, default=os.environ.get("LLAMA_SERVER") or None,
        help="a llama-server binary to measure after pagedserve, on the default model's "
        "GGUF (default: $LLAMA_SERVER; ../shared/peers/llama_server.sh builds one)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="report folder")
    args = parser.parse_args(argv)
    args.serve_variant = args.serve_variant or [DEFAULT_VARIANT]
    names = [name for name, _ in args.serve_variant]
    if len(set(names)) != len(names):
        parser.error(f"--serve-variant names must differ: {names}")
    for key, value in SUITES[args.suite].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def throughput_flags(args: argparse.Namespace, *suite_flags: str) -> list[str]:
    """bench.throughput's flags: the suite's, then `--model`, then `--throughput-args`; of a
    flag given twice, argparse keeps the last."""
    model = [] if args.model is None else [f"--model={args.model}"]
    return [*suite_flags, *model, *args.throughput_args]


def run_throughput(flags: Sequence[str], path: Path) -> tuple[str, dict[str, Any]]:
    """`bench.throughput` with `flags`: its table and its JSON report (written to `path`)."""
    table = run_module("bench.throughput", *flags, f"--json={path}")
    return table, json.loads(path.read_text())


def run_serving(
    args: argparse.Namespace, offline: dict[str, Any], plot: bool
) -> list[tuple[str, str, dict[str, Any]]]:
    """bench.serve against each `--serve-variant` of pagedserve, then llama-server when
    `--llama-server` is given, each started for it and stopped before the next, at every
    level of `--concurrency`, with the offline workload's mean output length and about its
    mean prompt length (one random word is about one token). Per server, in that order:
    its name, its table and its JSON report."""
    workload = offline["workload"]
    prompt_words = max(1, round(workload["prompt_tokens"] / workload["requests"]))
    max_tokens = round(workload["output_tokens"] / workload["requests"])
    flags = [
        f"--concurrency={','.join(map(str, args.concurrency))}",
        f"--max-tokens={max_tokens}",
        f"--prompt-words={prompt_words}",
        "--ignore-eos",
    ]
    results = []
    for name, server_flags in args.serve_variant:
        suffix = "" if name == DEFAULT_VARIANT[0] else f"-{name}"
        extra = [f"--plot={args.out / f'serve{suffix}.png'}"] if plot else []
        port = free_port()
        server = start_server(
            args.config, port, args.out / f"server{suffix}.log", args.model, server_flags
        )
        results.append((name, *measure(port, args.out / f"serve{suffix}.json", flags + extra)))
        stop_server(server)
    if args.llama_server is not None:
        port, log = free_port(), args.out / "llama-server.log"
        peer = wait_healthy(start_llama_server(args.llama_server, port, log), port, log)
        results.append(("llama-server", *measure(port, args.out / "serve-llama.json", flags)))
        stop_server(peer)
    return results


def measure(port: int, path: Path, flags: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """bench.serve against 127.0.0.1:`port`: its table and its JSON report (in `path`)."""
    table = run_module("bench.serve", f"--url=http://127.0.0.1:{port}", *flags, f"--json={path}")
    return table.rstrip(), json.loads(path.read_text())


def side_by_side(results: Sequence[tuple[str, str, dict[str, Any]]]) -> str:
    """One row per server: output tok/s at every level, TPOT p50 at the lowest and TTFT p50
    at the highest (the table of the README's latency comparison)."""
    levels = sorted(entry["concurrency"] for entry in results[0][2]["levels"])
    low, high = levels[0], levels[-1]
    headers = ["server"] + [f"c={level} tok/s" for level in levels]
    headers += [f"TPOT p50 c={low} ms", f"TTFT p50 c={high} ms"]
    rows = []
    for name, _, report in results:
        by_level = {entry["concurrency"]: entry for entry in report["levels"]}
        row = [name] + [f"{by_level[level]['output_throughput']:.1f}" for level in levels]
        for level, metric in ((low, "tpot_ms"), (high, "ttft_ms")):
            value = by_level[level][metric]["p50"]
            row.append("-" if value is None else f"{value:.1f}")
        rows.append(row)
    return format_table(headers, rows)


def default_suite(args: argparse.Namespace) -> list[str]:
    """The offline run, pagedserve alone at the highest concurrency, then the server."""
    offline_table, offline = run_throughput(throughput_flags(args), args.out / "throughput.json")
    concurrency = max(args.concurrency)
    matched_table, matched = run_throughput(
        [*throughput_flags(args), "--engines=pagedserve", f"--max-num-seqs={concurrency}"],
        args.out / "throughput-matched.json",
    )
    servers = run_serving(args, offline, plot=True)
    lines = [
        "== offline throughput: python -m bench.throughput ==",
        offline_table.rstrip(),
        f"\n== the same, pagedserve with at most {concurrency} sequences in a batch ==",
        matched_table.rstrip(),
    ]
    for name, table, _ in servers:
        lines += [f"\n== HTTP serving, {name}: python -m bench.serve (latencies in ms) ==", table]
    lines += ["\n== serving against offline ==", comparison(offline, matched, servers[0][2])]
    if len(servers) > 1:
        lines += ["\n== the servers side by side ==", side_by_side(servers)]
    return lines


def require_cuda() -> None:
    """Refuse, before any run, to measure a GPU suite without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "bench.run_all: --suite gpu needs a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"
        )


def gpu_suite(args: argparse.Namespace) -> list[str]:
    """Each of GPU_WORKLOADS through pagedserve and generate_batch, then the server with
    W1's shape (no plot: the GPU image need not have matplotlib)."""
    lines, reports = [], {}
    for workload in GPU_WORKLOADS:
        flags = throughput_flags(args, f"--workload={workload}", *GPU_THROUGHPUT_FLAGS)
        table, reports[workload] = run_throughput(flags, args.out / f"throughput-{workload}.json")
        lines += [f"== offline {workload}: python -m bench.throughput ==", table.rstrip(), ""]
    for name, table, _ in run_serving(args, reports["w1"], plot=False):
        lines += [f"== HTTP serving, {name}, W1's shape: python -m bench.serve ==", table, ""]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.suite == "gpu":
        require_cuda()
    args.out.mkdir(parents=True, exist_ok=True)
    tables = "\n".join(gpu_suite(args) if args.suite == "gpu" else default_suite(args))
    (args.out / "tables.txt").write_text(tables + "\n")
    print(tables)
    print(f"\nreports in {args.out}/")


if __name__ == "__main__":
    main()
