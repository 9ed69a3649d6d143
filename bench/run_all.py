"""`make bench`: offline throughput, then the same model served over HTTP, side by side.

Runs `python -m bench.throughput` (with its defaults, or `--throughput-args`), then
pagedserve alone on the same workload with `--max-num-seqs` set to the highest serving
concurrency, then starts `pagedserve serve --config CONFIG` on a free loopback port, runs
`python -m bench.serve` against it at concurrency 1, 8 and 32 with the offline run's output
length and about its prompt length (one random word is about one token), and stops the
server. Prints the tables and the serving output throughput at the highest concurrency
next to the offline figures; the HTTP overhead is taken against the offline run with as
many sequences in a batch as the server had in flight. The runs take turns, so they
never share the CPU. Reports, the server log and the plot go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.tables import free_port, positive_ints

READY_TIMEOUT = 600.0  # the first start converts the default model
STOP_TIMEOUT = 60.0


def run_module(module: str, *args: str) -> str:
    """Run `python -m module args`, its log passing through; return its stdout."""
    command = [sys.executable, "-m", module, *args]
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    return subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout


def start_server(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`pagedserve serve` on 127.0.0.1:`port`, returned once /health answers 200."""
    command = [sys.executable, "-m", "server", "serve", "--config", str(config)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    print(f"$ {' '.join(command)} > {log} 2>&1", file=sys.stderr, flush=True)
    with log.open("wb") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
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
    parser.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument(
        "--concurrency", type=positive_ints, default=[1, 8, 32], help="bench.serve's levels"
    )
    parser.add_argument(
        "--throughput-args",
        type=shlex.split,
        default=[],
        help="extra bench.throughput flags, e.g. '--engines pagedserve --num-requests 16'",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="report folder")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    offline_json, serving_json = args.out / "throughput.json", args.out / "serve.json"
    matched_json = args.out / "throughput-matched.json"

    offline_table = run_module(
        "bench.throughput", *args.throughput_args, "--json", str(offline_json)
    )
    offline = json.loads(offline_json.read_text())
    workload = offline["workload"]
    concurrency = max(args.concurrency)
    matched_table = run_module(
        "bench.throughput", *args.throughput_args, "--engines=pagedserve",
        f"--max-num-seqs={concurrency}", "--json", str(matched_json),
    )  # fmt: skip
    matched = json.loads(matched_json.read_text())
    prompt_words = max(1, round(workload["prompt_tokens"] / workload["requests"]))

    port = free_port()
    server = start_server(args.config, port, args.out / "server.log")
    try:
        serving_table = run_module(
            "bench.serve",
            f"--url=http://127.0.0.1:{port}",
            f"--concurrency={','.join(map(str, args.concurrency))}",
            f"--max-tokens={workload['output_len']}",
            f"--prompt-words={prompt_words}",
            "--ignore-eos",
            f"--json={serving_json}",
            f"--plot={args.out / 'serve.png'}",
        )
    finally:
        stop_server(server)
    serving = json.loads(serving_json.read_text())

    print("== offline throughput: python -m bench.throughput ==")
    print(offline_table.rstrip())
    print(f"\n== the same, pagedserve with at most {concurrency} sequences in a batch ==")
    print(matched_table.rstrip())
    print("\n== HTTP serving: python -m bench.serve (latencies in ms) ==")
    print(serving_table.rstrip())
    print("\n== serving against offline ==")
    print(comparison(offline, matched, serving))
    print(f"\nreports in {args.out}/")


if __name__ == "__main__":
    main()
