"""Soak test: does a server's memory stay flat over many streams, some of them abandoned?

`python -m bench.soak` starts `pagedserve serve --config CONFIG` on a free loopback port
(or, with `--url`, uses a server already running on this machine, found by its listening
port or given by `--pid`), then streams `--requests` completions (`POST /v1/completions`)
in four equal quarters, `--concurrency` in flight at a time. A `--disconnect-fraction`
of the requests, spread over the run, close their connection after a random number of
content chunks, mid-stream; the others must stream to a finish_reason and `data: [DONE]`.
Prompts are `bench.serve`'s seeded random words, cut to a seeded random length in
[`--min-prompt-words`, `--max-prompt-words`], so steps come in many sizes, as in real
traffic; each request asks for a seeded random length in [`--min-tokens`,
`--max-tokens`] with `ignore_eos`, so a run is repeatable.

After a warm-up round, and after each quarter, the soak lets the requests in flight end,
waits until `/metrics` shows no KV-cache block in use and no request running or waiting,
and reads the server process's resident set size (RSS), and its anonymous part (RSS less
file-backed pages, which the kernel drops and reads back as memory gets short, so they
move RSS by tens of MB without any allocation): every sample is taken in the same idle
state, so quarters compare like with like. The run passes when RSS grew less than
`--max-growth` percent (default 2) from the second quarter's sample to the fourth's, every
KV block came back, and no request failed. `--max-seconds` bounds the whole run: past it
no new request starts, and a run that did not reach its fourth quarter fails. Exit status
0 on a pass, 1 on a fail. Only loopback servers are contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.run_all import start_server, stop_server
from bench.serve import Benchmark, make_prompts, sse_data
from bench.tables import format_table, free_port

QUARTERS = 4
# The second quarter's sample is the baseline of the growth that decides a pass: by then
# the server has seen every batch shape the workload makes.
BASELINE_QUARTER = 2
IDLE_TIMEOUT = 60.0  # seconds for the server to report no KV block in use after a quarter
# The families whose samples must all read 0 when no request is in flight.
BUSY_SERIES = (
    "pagedserve_kv_cache_used_blocks",
    "pagedserve_num_requests_running",
    "pagedserve_num_requests_waiting",
)


@dataclass(frozen=True, slots=True)
class Plan:
    """One request: its prompt, its max_tokens, and after how many content chunks its
    client disconnects (None: it reads the stream to the end)."""

    prompt: str
    max_tokens: int
    disconnect_after: int | None


@dataclass(slots=True)
class Sample:
    """The server at rest after `requests` requests: its process's RSS, the anonymous
    part of it, and what `/metrics` reported (`busy`: the BUSY_SERIES values, all 0 when
    it came to rest)."""

    label: str
    requests: int
    errors: int
    disconnects: int
    rss_bytes: int
    anon_bytes: int
    busy: dict[str, float]
    elapsed_s: float

    @property
    def idle(self) -> bool:
        return all(value == 0 for value in self.busy.values())


def make_plans(args: argparse.Namespace, count: int) -> list[Plan]:
    """`count` requests; exactly round(count * disconnect_fraction) of them, seeded, leave
    mid-stream, after 1 to max_tokens - 1 chunks."""
    rng = random.Random(args.seed)
    prompts = [
        " ".join(prompt.split()[: rng.randint(args.min_prompt_words, args.max_prompt_words)])
        for prompt in make_prompts(count, args.max_prompt_words, args.seed)
    ]
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(count)]
    leaving = set(rng.sample(range(count), round(count * args.disconnect_fraction)))
    return [
        Plan(prompt, length, rng.randint(1, length - 1) if i in leaving else None)
        for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True))
    ]


class Soak:
    """Streams plans at `base_url` (the server root) and samples the process `pid`."""

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, pid: int, args: argparse.Namespace
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.process = psutil.Process(pid)
        self.args = args
        self.bench = Benchmark(client, base_url, args)
        self.start = time.monotonic()
        self.done = self.errors = self.disconnects = 0
        self.error_samples: list[str] = []

    def out_of_time(self) -> bool:
        return time.monotonic() - self.start > self.args.max_seconds

    async def request(self, model: str, plan: Plan) -> None:
        """One streamed request; counts it as done, and as an error or a disconnect."""
        body = self.bench.body(model, plan.prompt) | {"max_tokens": plan.max_tokens}
        try:
            error = await self._stream(body, plan.disconnect_after)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.done += 1
        if error is not None:
            self.errors += 1
            if len(self.error_samples) < 3:
                self.error_samples.append(error[:200])
        elif plan.disconnect_after is not None:
            self.disconnects += 1

    async def _stream(self, body: dict[str, Any], disconnect_after: int | None) -> str | None:
        """None when the stream went as planned: to a finish_reason and [DONE], or up to
        its disconnect (leaving the `stream` block unread closes the connection)."""
        url = f"{self.base_url}/v1/completions"
        async with self.client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return f"HTTP {response.status_code}: {detail}"
            chunks, finished = 0, False
            async for data in sse_data(response):
                if data == "[DONE]":
                    return None if finished else "[DONE] before any finish_reason"
                chunk = json.loads(data)
                if "error" in chunk:
                    return f"stream error: {chunk['error']}"
                choices = chunk.get("choices") or ()
                finished = finished or any(c.get("finish_reason") for c in choices)
                if any(choice.get("text") for choice in choices):
                    chunks += 1
                    if chunks == disconnect_after:
                        return None
            return "the stream ended without [DONE]"

    async def run_plans(self, model: str, plans: Sequence[Plan]) -> None:
        """Run `plans` with `concurrency` in flight; none starts once out of time."""
        pending = iter(plans)  # shared: each worker takes the next plan when it is free

        async def worker() -> None:
            for plan in pending:
                if self.out_of_time():
                    return
                await self.request(model, plan)

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def busy(self) -> dict[str, float]:
        """The BUSY_SERIES values (summed over labels) of one scrape of /metrics;
        RuntimeError if one is missing (not a pagedserve server)."""
        response = await self.client.get(f"{self.base_url}/metrics")
        response.raise_for_status()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in BUSY_SERIES:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        missing = set(BUSY_SERIES) - set(values)
        if missing:
            raise RuntimeError(f"/metrics has no {', '.join(sorted(missing))}")
        return values

    async def sample(self, label: str) -> Sample:
        """Wait (up to IDLE_TIMEOUT) for the server to come to rest, then read its RSS."""
        deadline = time.monotonic() + IDLE_TIMEOUT
        busy = await self.busy()
        while any(busy.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            busy = await self.busy()
        memory = self.process.memory_info()
        return Sample(
            label=label,
            requests=self.done,
            errors=self.errors,
            disconnects=self.disconnects,
            rss_bytes=memory.rss,
            anon_bytes=memory.rss - memory.shared,  # Linux: shared is RssFile + RssShmem
            busy=busy,
            elapsed_s=time.monotonic() - self.start,
        )


async def soak(args: argparse.Namespace, base_url: str, pid: int) -> tuple[str, list[Sample], Soak]:
    """The warm-up sample, then one per quarter; fewer if `max_seconds` ran out."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout, connect=10.0)
    ) as client:
        runner = Soak(client, base_url, pid, args)
        # A started server serves `--model` under its own name; an attached one is asked
        # for `--model` as given.
        model = args.model if args.url and args.model else await runner.bench.first_model()
        plans = make_plans(args, args.warmup + args.requests)
        # Counts include the warm-up's requests: every request the server has served.
        bounds = [args.warmup + q * args.requests // QUARTERS for q in range(QUARTERS + 1)]
        await runner.run_plans(model, plans[: bounds[0]])
        samples = [await runner.sample("warm-up")]
        for quarter in range(1, QUARTERS + 1):
            await runner.run_plans(model, plans[bounds[quarter - 1] : bounds[quarter]])
            if runner.done < bounds[quarter]:  # out of time: this quarter is incomplete
                samples.append(await runner.sample(f"stopped at Q{quarter}"))
                break
            samples.append(await runner.sample(f"Q{quarter}"))
            print(f"Q{quarter}: {runner.done} requests", file=sys.stderr, flush=True)
        return model, samples, runner


def growth_percent(samples: Sequence[Sample]) -> float | None:
    """RSS growth from the BASELINE_QUARTER sample to the last quarter's, in percent;
    None unless the run reached its last quarter."""
    by_label = {sample.label: sample for sample in samples}
    first, last = by_label.get(f"Q{BASELINE_QUARTER}"), by_label.get(f"Q{QUARTERS}")
    if first is None or last is None:
        return None
    return 100.0 * (last.rss_bytes / first.rss_bytes - 1.0)


def verdict(samples: Sequence[Sample], max_growth: float) -> list[str]:
    """The reasons the run failed; empty for a pass."""
    reasons = []
    growth = growth_percent(samples)
    if growth is None:
        reasons.append(f"the run did not reach Q{QUARTERS} within --max-seconds")
    elif growth >= max_growth:
        reasons.append(f"RSS grew {growth:+.2f}% over the last half (limit {max_growth}%)")
    last = samples[-1]
    if not last.idle:
        busy = ", ".join(f"{name} {value:g}" for name, value in last.busy.items() if value)
        reasons.append(f"the server did not come to rest: {busy}")
    if last.errors:
        reasons.append(f"{last.errors} requests failed")
    return reasons


def format_report(samples: Sequence[Sample]) -> str:
    headers = ["point", "requests", "errors", "disconnects", "RSS MiB", "change %", "anon MiB"]
    headers += ["KV blocks", "seconds"]
    rows = []
    for previous, sample in zip([None, *samples], samples, strict=False):
        change = (
            "-" if previous is None else f"{100 * (sample.rss_bytes / previous.rss_bytes - 1):+.2f}"
        )
        rows.append(
            [
                sample.label,
                str(sample.requests),
                str(sample.errors),
                str(sample.disconnects),
                f"{sample.rss_bytes / 2**20:.1f}",
                change,
                f"{sample.anon_bytes / 2**20:.1f}",
                f"{sample.busy['pagedserve_kv_cache_used_blocks']:g}",
                f"{sample.elapsed_s:.0f}",
            ]
        )
    return format_table(headers, rows)


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_pid(port: int) -> int:
    """The process listening on loopback TCP `port` (needs the right to see its sockets)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise SystemExit(f"bench.soak: no process of ours listens on port {port}; pass --pid")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Stream many completions, some abandoned, and check that the server's "
        "RSS stays flat, its KV blocks all come back and no request fails.",
    )
    parser.add_argument(
        "--url", help="a loopback server to use, e.g. http://127.0.0.1:8000; default: start one"
    )
    parser.add_argument("--pid", type=int, help="with --url: the server's process id")
    parser.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument(
        "--model", help="the model to serve, or with --url to request; default: the config's, "
        "or the first of /v1/models",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=1000, help="measured requests")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--disconnect-fraction", type=float, default=0.25)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-prompt-words", type=int, default=16)
    parser.add_argument("--max-prompt-words", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument(
        "--warmup", type=int, default=48, help="requests before the first sample, uncounted"
    )
    parser.add_argument("--max-growth", type=float, default=2.0, help="percent, Q2 to Q4")
    parser.add_argument("--max-seconds", type=float, default=2400.0, help="for the whole run")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", help="sent as a bearer token")
    parser.add_argument(
        "--server-log", type=Path, default=Path("bench/results/soak-server.log"),
        help="the started server's output",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the report to this file")
    args = parser.parse_args(argv)
    if args.requests < QUARTERS or args.concurrency < 1 or args.warmup < 0:
        parser.error(f"need --requests >= {QUARTERS}, --concurrency >= 1, --warmup >= 0")
    if not 2 <= args.min_tokens <= args.max_tokens:
        parser.error("need 2 <= --min-tokens <= --max-tokens (a disconnect needs 2 tokens)")
    if not 1 <= args.min_prompt_words <= args.max_prompt_words:
        parser.error("need 1 <= --min-prompt-words <= --max-prompt-words")
    if not 0 <= args.disconnect_fraction <= 1:
        parser.error("--disconnect-fraction must be in [0, 1]")
    if args.url is not None and not is_loopback(args.url):
        parser.error("--url must be a loopback address (127.0.0.0/8, ::1 or localhost)")
    # read by Benchmark.body: every request runs to its max_tokens, on random prompts, with
    # the server's default repetition penalty
    args.ignore_eos, args.workload, args.repetition_penalty = True, "random", None
    return args


def write_json(path: Path, args: argparse.Namespace, model: str, samples: Sequence[Sample]) -> None:
    settings = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in vars(args).items()
        if key != "api_key"
    }
    report = {
        "model": model,
        "settings": settings,
        "samples": [asdict(sample) for sample in samples],
        "growth_percent": growth_percent(samples),
        "failures": verdict(samples, args.max_growth),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.url is None:
        port = free_port()
        args.server_log.parent.mkdir(parents=True, exist_ok=True)
        server = start_server(args.config, port, args.server_log, args.model)
        base_url, pid = f"http://127.0.0.1:{port}", server.pid
    else:
        base_url = args.url.rstrip("/").removesuffix("/v1")
        pid = args.pid or listening_pid(urlsplit(base_url).port or 80)
    try:
        model, samples, runner = asyncio.run(soak(args, base_url, pid))
    finally:
        if server is not None:
            stop_server(server)
    print(f"model {model}, {args.concurrency} concurrent, {args.disconnect_fraction:.0%} leave")
    print(format_report(samples))
    growth = growth_percent(samples)
    if growth is not None:
        print(f"RSS growth Q{BASELINE_QUARTER} -> Q{QUARTERS}: {growth:+.2f}%")
    for error in runner.error_samples:
        print(f"error: {error}")
    failures = verdict(samples, args.max_growth)
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    if args.json is not None:
        write_json(args.json, args, model, samples)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
