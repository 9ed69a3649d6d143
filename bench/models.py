"""What loading, unloading and waking a model cost, and whether unloading gives back what
loading took, on a server of several models (configs/models.yaml by default).

`python -m bench.models` starts `pagedserve serve --config FILE` (extra flags after `--`),
then for `--cycles` rounds loads the model named `--model` (`POST /models/load`), times a
first request to it, and unloads it (`POST /models/unload`), reading the server's resident
set after each unload. It prints the medians and the resident set after the first, the
second and the last unload (the first load leaves its libraries loaded for good; from the
second on, equal within noise when nothing leaks). Then it times a sleep and a wake.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import httpx

from bench.kv_tier import start_pagedserve
from bench.run_all import stop_server
from bench.sleep import rss_mib
from bench.tables import format_table


def timed(call: httpx.Client, path: str, body: dict | None = None) -> float:
    started = time.perf_counter()
    response = call.post(path, json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> tuple[list[list[str]], list[list[str]]]:
    server, url = start_pagedserve(args.config, args.server_args, "bench-models")
    request = {"model": args.model, "prompt": "The river towns of the north", "max_tokens": 16,
               "temperature": 0}  # fmt: skip
    loads, firsts, unloads, resident, loaded = [], [], [], [], []
    try:
        with httpx.Client(base_url=url) as client:
            start = rss_mib(server.pid)
            for _ in range(args.cycles):
                loads.append(timed(client, "/models/load", {"model": args.model}))
                firsts.append(timed(client, "/v1/completions", request))
                loaded.append(rss_mib(server.pid))
                unloads.append(timed(client, "/models/unload", {"model": args.model}))
                resident.append(rss_mib(server.pid))
            timed(client, "/models/load", {"model": args.model})
            sleep = timed(client, "/sleep?level=1")
            wake = timed(client, "/wake_up")
    finally:
        stop_server(server)
    ms = [f"{statistics.median(values) * 1000:.0f}" for values in (loads, firsts, unloads)]
    times = [[args.model, str(args.cycles), *ms, f"{sleep * 1000:.0f}", f"{wake * 1000:.0f}"]]
    # The first load leaves its libraries and the allocator's arenas behind for good; from
    # the second unload on, a leak would show as growth.
    second = resident[min(1, len(resident) - 1)]
    memory = [[f"{start:.0f}", f"{statistics.median(loaded):.0f}", f"{resident[0]:.0f}",
               f"{second:.0f}", f"{resident[-1]:.0f}", f"{max(resident[1:] or resident):.0f}",
               f"{(resident[-1] / second - 1) * 100:+.1f}%"]]  # fmt: skip
    return times, memory


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__)
    parser.add_argument("--config", default="configs/models.yaml")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("server_args", nargs="*", help="after --: more `pagedserve serve` flags")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    times, memory = run(parse_args(argv))
    print(format_table(["model", "cycles", "load ms", "first request ms", "unload ms",
                        "sleep ms", "wake ms"], times))  # fmt: skip
    print()
    print(format_table(["RSS before MiB", "RSS loaded MiB", "after 1st unload",
                        "after 2nd unload", "after last unload", "largest after 2nd",
                        "last vs 2nd"], memory))  # fmt: skip


if __name__ == "__main__":
    main()
