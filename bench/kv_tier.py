"""The disk KV tier on an agent-style workload: long shared system prompts, and a restart.

`python -m bench.kv_tier` runs one workload twice, each time against freshly started
`pagedserve serve --config configs/default.yaml --kv-cache-memory 128MiB --max-model-len 2048`
processes (plus any `--server-arg`): first with the tier off (`--kv-disk-size 0`), then on
(`--kv-disk-size 1GiB`, a fresh `--kv-disk-path` in a temporary folder under `--scratch`; the
system's temporary folder by default, which may be RAM-backed). `--num-prompts` seeded "system
prompts" of `--prefix-words` common words (about a token each) are shared by `--num-requests`
streamed greedy completions (max_tokens 16), each a system prompt and a distinct ~20-word user
turn, sent at `--concurrency` round-robin over the prompts in one seeded order, the same for
both runs. Together the prompts exceed the RAM KV cache (4 x 1,500 tokens against the ~2,900
of 128 MiB in fp32), so each is pushed out of RAM before it comes round again. After half the
requests the server is stopped (Ctrl-C: a graceful shutdown) and started again with the same
flags and folder. After each start one short untimed request warms it up.

One row per run: TTFT (time to the first streamed text) p50, p95 and mean in ms; prompt
tokens computed (prompt_tokens - cached_tokens, summed) and cached (the usage's
`prompt_tokens_details.cached_tokens`: from RAM or the tier), of which loaded from the tier
(`vllm:external_prefix_cache_hits_total`, both server lifetimes); the TTFT of the first
request after the restart; and the requests' wall time, starts and stops excluded. The last
line divides tier on by tier off: below 1 is the tier's gain. Failed requests are counted in
"errors" (a few are quoted) and left out of the other columns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.run_all import stop_server
from bench.serve import WORDS, sse_data
from bench.tables import format_table, free_port

ROOT = Path(__file__).resolve().parents[1]
SUFFIX_WORDS = 20
MAX_TOKENS = 16
TIER_HITS = "vllm:external_prefix_cache_hits_total"
READY_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class Request:
    system: int  # the index of the system prompt it starts with
    prompt: str


@dataclass(slots=True)
class Result:
    ttft: float = 0.0  # seconds
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class RunReport:
    label: str
    requests: int
    errors: list[str]
    ttft_ms: tuple[float, float, float] | None  # p50, p95, mean; None: no request succeeded
    prefill_tokens: int
    cached_tokens: int
    tier_tokens: int
    restart_ttft_ms: float | None
    wall_s: float

    def cells(self) -> list[str]:
        """The table's row, times in ms."""
        return [self.label, str(self.requests), str(len(self.errors)),
                *map(_ms, self.ttft_ms or (None, None, None)), str(self.prefill_tokens),
                str(self.cached_tokens), str(self.tier_tokens), _ms(self.restart_ttft_ms),
                f"{self.wall_s:.1f}"]  # fmt: skip


def make_workload(prompts: int, words: int, requests: int, seed: int) -> list[Request]:
    """The requests in sending order: round-robin over the system prompts in a seeded order."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(WORDS, k=words)) for _ in range(prompts)]
    order = rng.sample(range(prompts), prompts)
    return [
        Request(s, f"{systems[s]}\n\nUser {i}: {' '.join(rng.choices(WORDS, k=SUFFIX_WORDS))}")
        for i, s in zip(range(requests), cycle(order))
    ]


def summarize(
    label: str, results: Sequence[Result], tier_tokens: int, restart: int, wall: float
) -> RunReport:
    """One run's figures; `results[restart]` is the first request after the restart."""
    ok = [r for r in results if r.error is None]
    ms = [1000.0 * r.ttft for r in ok]
    stats = (*np.percentile(ms, [50, 95]), np.mean(ms)) if ms else None
    first = results[restart] if restart < len(results) else None
    return RunReport(
        label, len(results), [r.error for r in results if r.error is not None],
        None if stats is None else (float(stats[0]), float(stats[1]), float(stats[2])),
        sum(r.prompt_tokens - r.cached_tokens for r in ok), sum(r.cached_tokens for r in ok),
        tier_tokens, None if first is None or first.error else 1000.0 * first.ttft, wall,
    )  # fmt: skip


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> Result:
    """One streamed greedy completion; a failure becomes the result's error, never raised."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    result, start, text = Result(), time.perf_counter(), False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return Result(error=f"HTTP {response.status_code}: {detail}")
            async for data in sse_data(response):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result(error=f"stream error: {chunk['error']}"[:200])
                if not text and any(c.get("text") for c in chunk.get("choices") or ()):
                    result.ttft, text = time.perf_counter() - start, True
                if usage := chunk.get("usage"):
                    result.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return Result(error=f"{type(exc).__name__}: {exc}"[:200])
    if not text or not result.prompt_tokens:
        result.error = "the stream ended without text or without usage"
    return result


async def send_all(url: str, model: str, requests: Sequence[Request], conc: int) -> list[Result]:
    """`requests` in order, `conc` in flight; the results in the requests' order."""
    results = [Result() for _ in requests]
    pending = iter(enumerate(requests))  # shared: a free worker takes the next request
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:

        async def worker() -> None:
            for index, request in pending:
                results[index] = await send(client, url, model, request.prompt)

        await asyncio.gather(*(worker() for _ in range(conc)))
    return results


def start_server(command: Sequence[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    """The server, started from the repository root, once its /health answers 200."""
    print(f"$ {shlex.join(command)} >> {log} 2>&1", file=sys.stderr, flush=True)
    with log.open("ab") as sink:
        server = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"bench.kv_tier: the server did not become healthy:\n{tail}")
        time.sleep(0.5)


def start_pagedserve(
    config: str, flags: Sequence[str], name: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`pagedserve serve --config CONFIG FLAGS` on a free loopback port, its log in a
    temporary folder named after `name`, once healthy: the process and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedserve", "serve", "--config", config,
               "--host", "127.0.0.1", "--port", str(port), *flags]  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "server.log"
    return start_server(command, url, log), url


def tier_hits(url: str) -> int:
    """Prompt tokens the server has loaded from its tier (0 where the tier is off)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
    return int(sum(s.value for f in families for s in f.samples if s.name == TIER_HITS))


def run(
    label: str, command: Sequence[str], workload: Sequence[Request], conc: int, folder: Path
) -> RunReport:
    """The workload in two halves against one server each, the second restarted with the
    first's flags; the tier's hits are read before each stop."""
    port, log = free_port(), folder / f"{label.replace(' ', '-')}.log"
    url, half = f"http://127.0.0.1:{port}", len(workload) // 2
    results: list[Result] = []
    tier_tokens, wall = 0, 0.0
    for part in (workload[:half], workload[half:]):
        server = start_server([*command, "--port", str(port)], url, log)
        try:
            model = str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])
            warm = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            httpx.post(f"{url}/v1/completions", json=warm, timeout=600).raise_for_status()
            before, start = tier_hits(url), time.perf_counter()
            results += asyncio.run(send_all(url, model, part, conc))
            wall += time.perf_counter() - start
            tier_tokens += tier_hits(url) - before
        finally:
            stop_server(server)
        print(f"{label}: {len(results)}/{len(workload)} requests done", file=sys.stderr, flush=True)
    return summarize(label, results, tier_tokens, half, wall)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(on: float | None, off: float | None) -> str:
    return "-" if on is None or not off else f"{on / off:.2f}"


def format_report(off: RunReport, on: RunReport) -> str:
    """The table (times in ms), the ratios tier on / tier off, and a few errors of each run."""
    headers = ["run", "reqs", "errors", "TTFT p50", "TTFT p95", "TTFT mean", "prefill tok",
               "cached tok", "from tier", "TTFT after restart", "wall s"]  # fmt: skip
    rows = [r.cells() for r in (off, on)]
    a, b = (r.ttft_ms or (None, None, None) for r in (off, on))
    ratios = (f"tier on / off: TTFT p50 {_ratio(b[0], a[0])}, TTFT p95 {_ratio(b[1], a[1])}, "
              f"prefill tokens {_ratio(on.prefill_tokens, off.prefill_tokens)}")  # fmt: skip
    errors = [f"{r.label} error: {e}" for r in (off, on) for e in sorted(set(r.errors))[:3]]
    return "\n".join([format_table(headers, rows), ratios, *errors])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv_tier",
        description="Shared long prompts and a restart, the disk KV tier off, then on.",
    )
    for flag, default, help_ in [
        ("--num-prompts", 4, "system prompts"), ("--prefix-words", 1500, "words per prompt"),
        ("--num-requests", 24, "requests, restart after half"), ("--concurrency", 1, None),
        ("--max-model-len", 2048, None), ("--seed", 0, "the workload's seed"),
    ]:  # fmt: skip
        parser.add_argument(flag, type=int, default=default, help=help_)
    parser.add_argument("--kv-cache-memory", default="128MiB", help="the RAM KV cache")
    parser.add_argument("--kv-disk-size", default="1GiB", help="the tier's budget when on")
    parser.add_argument("--scratch", type=Path, help="folder of the tier's temporary folder")
    parser.add_argument("--server-arg", action="append", default=[], help="repeatable")
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.prefix_words, args.num_requests, args.concurrency) < 1:
        parser.error("the counts must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    workload = make_workload(args.num_prompts, args.prefix_words, args.num_requests, args.seed)
    base = [sys.executable, "-m", "pagedserve", "serve", "--config", "configs/default.yaml",
            "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
            *args.server_arg, "--host", "127.0.0.1"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-kv-tier-", dir=args.scratch) as scratch:
        folder = Path(scratch)
        tier = ["--kv-disk-size", args.kv_disk_size, "--kv-disk-path", str(folder / "kv")]
        commands = {"tier off": [*base, "--kv-disk-size", "0"], "tier on": [*base, *tier]}
        off, on = (
            run(label, cmd, workload, args.concurrency, folder) for label, cmd in commands.items()
        )
    print(f"$ python -m bench.kv_tier {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{args.num_prompts} system prompts of {args.prefix_words} words, {args.num_requests} "
          f"requests (+{SUFFIX_WORDS} words each), concurrency {args.concurrency}, "
          f"max_tokens {MAX_TOKENS}, seed {args.seed}, restart after "
          f"{args.num_requests // 2} requests")  # fmt: skip
    for label, command in commands.items():
        print(f"{label}: {shlex.join(command)} --port <free>")
    print(format_report(off, on))


if __name__ == "__main__":
    main()
