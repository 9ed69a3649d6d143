"""What sleep gives back and what waking costs, on `make serve`'s model and settings.

`python -m bench.sleep` starts `pagedserve serve --config configs/default.yaml` (extra
flags after `--`), sends a few requests, then per level and round: `POST /sleep?level=N`
(its time, the bytes it reports, the server's resident set before and after), and the
latency of the first request after it (it wakes the engine) against a request of the same
size while awake. Every request has a prompt of its own (`--prompt-words` random words, 16
tokens out), so none finds its prefix cached and the two latencies compare the same work.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

import httpx
import psutil

from bench.kv_tier import start_pagedserve
from bench.run_all import stop_server
from bench.serve import WORDS
from bench.tables import format_table


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def request_seconds(url: str, rng: random.Random, words: int) -> float:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> list[list[str]]:
    server, url = start_pagedserve(args.config, args.server_args, "bench-sleep")
    rng = random.Random(0)
    rows = []
    try:
        for _ in range(3):
            request_seconds(url, rng, args.prompt_words)
        for level in args.levels:
            for _ in range(args.rounds):
                awake = statistics.median(
                    request_seconds(url, rng, args.prompt_words) for _ in range(3)
                )
                before = rss_mib(server.pid)
                started = time.perf_counter()
                report = httpx.post(f"{url}/sleep", params={"level": level}, timeout=600).json()
                slept = time.perf_counter() - started
                after = rss_mib(server.pid)
                first = request_seconds(url, rng, args.prompt_words)
                rows.append([
                    str(level), f"{slept * 1000:.0f}", f"{report['released_bytes'] / 2**20:.0f}",
                    f"{before:.0f}", f"{after:.0f}", f"{first * 1000:.0f}",
                    f"{awake * 1000:.0f}", f"{(first - awake) * 1000:+.0f}",
                ])  # fmt: skip
    finally:
        stop_server(server)
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sleep", description=__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("server_args", nargs="*", help="after --: more `pagedserve serve` flags")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    rows = run(parse_args(argv))
    headers = ["level", "sleep ms", "released MiB", "RSS before MiB", "RSS asleep MiB",
               "first request after ms", "awake request ms", "wake cost ms"]  # fmt: skip
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
