"""A chat model and an embedding model in one server: what each costs the other.

`python -m bench.mixed` serves the default chat model and all-MiniLM-L6-v2 (from its
package, `bench.embeddings`) in one `pagedserve serve` (each its own entry of a config
it writes; extra server flags after `--`), then measures the chat model's c=1 time per
output token (`bench.serve`: `--requests` streams of `--max-tokens` tokens after 100-word
prompts, the median TPOT) with the embedding model unloaded, loaded and idle, and busy
(one client sending `--batch` texts a request without pause), and the embedding model's
texts per second alone and beside the chat streams.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.embeddings import MODEL, model_folder, post, texts
from bench.kv_tier import start_pagedserve
from bench.run_all import stop_server
from bench.tables import format_table

CHAT = "chat"


def chat_tpot(url: str, args: argparse.Namespace) -> float:
    """The chat model's median c=1 TPOT in ms, by `bench.serve`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        subprocess.run(
            [sys.executable, "-m", "bench.serve", "--url", url, "--model", CHAT,
             "--concurrency", "1", "--num-requests", str(args.requests), "--max-tokens",
             str(args.max_tokens), "--prompt-words", "100", "--ignore-eos", "--json",
             report.name],
            check=True, capture_output=True,
        )  # fmt: skip
        return json.loads(Path(report.name).read_text())["levels"][0]["tpot_ms"]["p50"]


def embedding_rate(url: str, inputs: list[str], batch: int, stop: threading.Event) -> float:
    """Texts per second sending `batch` texts a request, one request at a time, until
    `stop` is set (at least one request)."""
    started, done = time.perf_counter(), 0
    while not done or not stop.is_set():
        post(url, [inputs[(done + i) % len(inputs)] for i in range(batch)])
        done += batch
    return done / (time.perf_counter() - started)


def embedding_alone(url: str, inputs: list[str], args: argparse.Namespace) -> float:
    """The embedding model's rate alone (the chat model idle), over `args.seconds`."""
    stop = threading.Event()
    timer = threading.Timer(args.seconds, stop.set)
    timer.start()
    return embedding_rate(url, inputs, args.batch, stop)


def beside_chat(url: str, inputs: list[str], args: argparse.Namespace) -> tuple[float, float]:
    """The chat TPOT while one client embeds without pause, and that client's rate."""
    stop = threading.Event()
    rate: list[float] = []
    client = threading.Thread(
        target=lambda: rate.append(embedding_rate(url, inputs, args.batch, stop))
    )
    client.start()
    try:
        tpot = chat_tpot(url, args)
    finally:
        stop.set()
        client.join()
    return tpot, rate[0]


def write_config(folder: Path) -> Path:
    config = Path(tempfile.mkdtemp(prefix="bench-mixed-")) / "models.yaml"
    config.write_text(
        "max_loaded_models: 2\nmodels:\n"
        f"  - {{name: {CHAT}, model: default, keep_alive: -1, kv_cache_memory: 1GiB}}\n"
        f"  - {{name: {MODEL}, model: {folder}, keep_alive: -1}}\n"
    )
    return config


def run(args: argparse.Namespace) -> list[list[str]]:
    inputs = texts(64)
    server, url = start_pagedserve(str(write_config(model_folder(args.root))), args.server_args,
                                   "bench-mixed")  # fmt: skip
    try:
        httpx.post(f"{url}/models/load", json={"model": CHAT}, timeout=600).raise_for_status()
        alone = chat_tpot(url, args)
        post(url, inputs[:8])  # loads the embedding model
        embed_alone = embedding_alone(url, inputs, args)
        idle = chat_tpot(url, args)
        busy, embed_busy = beside_chat(url, inputs, args)
    finally:
        stop_server(server)
    return [
        ["chat c=1 TPOT ms", f"{alone:.1f}", f"{idle:.1f}", f"{busy:.1f}"],
        [
            f"{MODEL} texts/s ({args.batch} a request)",
            "",
            f"{embed_alone:.1f}",
            f"{embed_busy:.1f}",
        ],
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mixed", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=4, help="chat streams per measurement")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="texts per embedding request")
    parser.add_argument("--seconds", type=float, default=20.0, help="the embedding model alone")
    parser.add_argument("--root", type=Path, default=Path("/var/tmp/pagedserve-embeddings"))
    parser.add_argument("server_args", nargs="*", help="after --: pagedserve serve flags")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    headers = ["", "embedding model unloaded", "loaded, idle", "both busy"]
    print(format_table(headers, run(args)))


if __name__ == "__main__":
    main()
