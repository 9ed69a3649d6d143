"""Scale-out benchmark: one multi-tenant workload against two engine replicas on Ray Serve
with prefix-aware routing, the same with Ray Serve's power-of-two-choices routing, and one
`pagedserve serve` with all of their CPUs and KV-cache memory, one after another in one run.

`python -m bench.scale_out` builds `--tenants` system prompts of `--system-tokens` tokens
(seeded random common words) and `--questions` short questions per tenant, and sends them
as streamed chat completions (`--max-tokens` each, end of sequence ignored) in a seeded
random order at a steady `--rate`: request i leaves at i / rate seconds, whatever the
answers before it. Per setup it reports, from the client: time to first token (p50, p99),
output tokens/s and requests/s over the time from the first request to the last answer;
from each replica's /metrics: the prefix-cache hit rate (prompt tokens served from the
cache / prompt tokens looked up) and the requests it served; and, behind the ingress, how
many tenants were served by more than one replica (`X-Pagedserve-Replica`).

Sizing: each replica's KV cache (`--kv-cache-memory`) holds about half the tenants'
prompts; the single server gets the replicas' memory together, so it holds them all.
This is the regime prefix-aware routing is for: the tenants' working set fits the
replicas' caches together, not each one's. Routed at random, every replica sees every
tenant and evicts prompts it will be asked for again; routed by prefix, each replica keeps
its own tenants. A request still running when a setup's `--max-seconds` pass is cancelled
and counted as unfinished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.run_all import start_server, stop_server
from bench.serve import WORDS, Stats, sse_data
from bench.tables import format_table, free_port

CONFIG = Path("configs/default.yaml")
# (tenant, chat body) in sending order.
Workload = list[tuple[int, dict[str, Any]]]
SETUPS = ("prefix", "pow2", "single")
_COUNTERS = {
    "pagedserve_prefix_cache_queries_total": "queried",
    "pagedserve_prefix_cache_hits_total": "hit",
    "pagedserve_e2e_request_latency_seconds_count": "requests",
}


@dataclass(slots=True)
class Outcome:
    """One streamed request: seconds to its first content chunk and to its end."""

    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    error: str | None = None
    replica: str | None = None  # the X-Pagedserve-Replica header (scale-out only)


@dataclass(slots=True)
class ReplicaCache:
    """What one replica's counters moved by during a setup (prompt tokens and requests)."""

    replica: str
    queried: float = 0
    hit: float = 0
    requests: float = 0

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0


@dataclass(slots=True)
class SetupReport:
    setup: str
    requests: int
    finished: int
    unfinished: int
    errors: list[str]
    duration_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    output_tokens_per_s: float
    requests_per_s: float
    replicas: list[ReplicaCache] = field(default_factory=list)
    # Tenants whose requests were served by more than one replica (scale-out only).
    split_tenants: int = 0

    @property
    def hit_rate(self) -> float:
        queried = sum(r.queried for r in self.replicas)
        return sum(r.hit for r in self.replicas) / queried if queried else 0.0


def build_workload(args: argparse.Namespace) -> Workload:
    """(tenant, chat body) in sending order: every tenant's questions, shuffled together."""
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_folder

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_folder(args.model)[0])
    rng = random.Random(args.seed)
    systems = []
    for tenant in range(args.tenants):
        words = " ".join(rng.choices(WORDS, k=args.system_tokens))
        ids = tokenizer.encode(words, add_special_tokens=False)[: args.system_tokens]
        systems.append(f"You are the assistant of tenant {tenant}. {tokenizer.decode(ids)}")
    bodies = [
        (
            tenant,
            {
                "model": "bench",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": " ".join(rng.choices(WORDS, k=12)) + "?"},
                ],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        for tenant, system in enumerate(systems)
        for _ in range(args.questions)
    ]
    rng.shuffle(bodies)
    return bodies


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    outcome = Outcome()
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            outcome.replica = response.headers.get("x-pagedserve-replica")
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {text[:160]}"
                return outcome
            async for data in sse_data(response):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = str(chunk["error"]["message"])[:160]
                    return outcome
                if outcome.ttft is None and any(
                    c["delta"].get("content") for c in chunk.get("choices", ())
                ):
                    outcome.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    outcome.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:160]
        return outcome
    outcome.latency = time.perf_counter() - start
    return outcome


async def warm_up(url: str, body: dict[str, Any]) -> None:
    """Two short requests outside the workload (a replica's first request pays one-time
    costs)."""
    async with httpx.AsyncClient(timeout=300) as client:
        for word in ("warm", "up"):
            message = [{"role": "user", "content": word}]
            await one_request(client, url, {**body, "messages": message, "max_tokens": 2})


async def run_workload(
    url: str, bodies: Sequence[dict[str, Any]], rate: float, max_seconds: float
) -> tuple[list[Outcome], float]:
    """Send `bodies` at `rate` per second; their outcomes, and the seconds from the first
    request to the last answer (or to the cut-off)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(max_seconds), limits=limits) as client:
        start = time.perf_counter()
        ended: list[float] = []

        async def timed(body: dict[str, Any], delay: float) -> Outcome:
            await asyncio.sleep(delay)
            outcome = await one_request(client, url, body)
            ended.append(time.perf_counter() - start)
            return outcome

        tasks = [asyncio.create_task(timed(body, i / rate)) for i, body in enumerate(bodies)]
        await asyncio.wait(tasks, timeout=max_seconds)
        outcomes = []
        for task in tasks:
            if task.done():
                outcomes.append(task.result())
            else:
                task.cancel()
                outcomes.append(Outcome(error=f"unfinished after {max_seconds:g} s"))
        await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes, max(ended, default=max_seconds)


def cache_counters(url: str) -> dict[str, ReplicaCache]:
    """The prefix-cache and request counters of every replica behind `url` (one, named
    'server', for a plain server)."""
    counters: dict[str, ReplicaCache] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            name = _COUNTERS.get(sample.name)
            if name is not None:
                replica = sample.labels.get("replica", "server")
                entry = counters.setdefault(replica, ReplicaCache(replica))
                setattr(entry, name, sample.value)
    return counters


def measure(setup: str, url: str, workload: Workload, args: argparse.Namespace) -> SetupReport:
    """Warm up with two short requests, then run the workload and read what moved."""
    bodies = [body for _, body in workload]
    asyncio.run(warm_up(url, bodies[0]))
    before = cache_counters(url)
    print(f"{setup}: sending {len(bodies)} requests", file=sys.stderr, flush=True)
    outcomes, duration = asyncio.run(run_workload(url, bodies, args.rate, args.max_seconds))
    after = cache_counters(url)
    replicas = []
    for replica, counters in sorted(after.items()):
        start = before.get(replica, ReplicaCache(replica))
        replicas.append(
            ReplicaCache(
                replica,
                counters.queried - start.queried,
                counters.hit - start.hit,
                counters.requests - start.requests,
            )
        )
    finished = [o for o in outcomes if o.error is None]
    placed: dict[int, set[str]] = {}
    for (tenant, _), outcome in zip(workload, outcomes, strict=True):
        if outcome.replica is not None:
            placed.setdefault(tenant, set()).add(outcome.replica)
    ttft = Stats.of([o.ttft for o in finished if o.ttft is not None])
    return SetupReport(
        setup=setup,
        requests=len(outcomes),
        finished=len(finished),
        unfinished=sum(1 for o in outcomes if o.error and o.error.startswith("unfinished")),
        errors=sorted({o.error for o in outcomes if o.error})[:3],
        duration_s=duration,
        ttft_p50_ms=ttft.p50,
        ttft_p99_ms=ttft.p99,
        output_tokens_per_s=sum(o.output_tokens for o in finished) / duration,
        requests_per_s=len(finished) / duration,
        replicas=replicas,
        split_tenants=sum(1 for replicas in placed.values() if len(replicas) > 1),
    )


@contextmanager
def ray_serve(args: argparse.Namespace) -> Iterator[str]:
    """A local Ray cluster with the replicas' CPUs and Serve's proxy on a free port."""
    from scale_out.launch import local_serve

    with local_serve(args.replicas * args.replica_cpus, free_port()) as url:
        yield url


def run_replicas(
    url: str, routing: str, workload: Workload, args: argparse.Namespace
) -> SetupReport:
    from ray import serve

    from scale_out.launch import APP_NAME, ScaleOut, build_application
    from server.config import ServeConfig

    config = ServeConfig(
        model=args.model,
        device="cpu",
        max_model_len=4096,
        kv_cache_memory=args.kv_cache_memory,
        served_model_name="bench",
        log_level="warning",
    )
    plan = ScaleOut(args.replicas, args.replica_cpus, 0, routing)  # type: ignore[arg-type]
    print(f"{routing}: starting {args.replicas} replicas", file=sys.stderr, flush=True)
    serve.run(build_application(config, plan, args.replica_cpus), name=APP_NAME, route_prefix="/")
    try:
        return measure(routing, url, workload, args)
    finally:
        serve.delete(APP_NAME)


def run_single(workload: Workload, args: argparse.Namespace) -> SetupReport:
    """One `pagedserve serve` with the replicas' CPUs (as torch threads) and KV memory."""
    cpus = args.replicas * args.replica_cpus
    memory = f"{args.replicas * _mebibytes(args.kv_cache_memory)}MiB"
    port = free_port()
    flags = ["--kv-cache-memory", memory, "--served-model-name", "bench", "--log-level", "warning"]
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(cpus)
    try:
        log = args.out / "scale_out_single_server.log"
        print(f"single: starting pagedserve serve with {cpus} threads", file=sys.stderr)
        server = start_server(CONFIG, port, log, model=args.model, flags=flags)
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    try:
        return measure("single", f"http://127.0.0.1:{port}", workload, args)
    finally:
        stop_server(server)


def _mebibytes(size: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(size)) // 2**20


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_report(reports: Sequence[SetupReport], args: argparse.Namespace) -> str:
    names = {
        "prefix": f"{args.replicas} replicas, prefix-aware",
        "pow2": f"{args.replicas} replicas, power of two",
        "single": f"1 server, {args.replicas * args.replica_cpus} threads",
    }
    summary = format_table(
        [
            "setup",
            "done",
            "unfinished",
            "split tenants",
            "hit rate",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "tok/s",
            "req/s",
        ],
        [
            [
                names[r.setup],
                f"{r.finished}/{r.requests}",
                str(r.unfinished),
                "-" if r.setup == "single" else f"{r.split_tenants}/{args.tenants}",
                f"{r.hit_rate:.0%}",
                _ms(r.ttft_p50_ms),
                _ms(r.ttft_p99_ms),
                f"{r.output_tokens_per_s:.1f}",
                f"{r.requests_per_s:.2f}",
            ]
            for r in reports
        ],
    )
    per_replica = format_table(
        ["setup", "replica", "requests", "prompt tokens", "hit rate"],
        [
            [
                names[r.setup],
                c.replica,
                f"{c.requests:.0f}",
                f"{c.queried:.0f}",
                f"{c.hit_rate:.0%}",
            ]
            for r in reports
            for c in r.replicas
        ],
    )
    errors = [f"{r.setup}: {e}" for r in reports for e in r.errors]
    workload = (
        f"{args.tenants} tenants x {args.questions} questions, {args.system_tokens}-token system "
        f"prompts, {args.max_tokens} output tokens, {args.rate:g} requests/s; KV cache "
        f"{args.kv_cache_memory} per replica; model {args.model}"
    )
    return "\n\n".join([workload, summary, per_replica, *(["errors:", *errors] if errors else [])])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=4, help="per tenant")
    parser.add_argument("--rate", type=float, default=0.4, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=int, default=1)
    parser.add_argument(
        "--kv-cache-memory",
        default="256MiB",
        help="per replica (the single server gets the replicas' total)",
    )
    parser.add_argument("--max-seconds", type=float, default=300, help="per setup")
    parser.add_argument(
        "--setups", default=",".join(SETUPS), help="a comma list of " + ", ".join(SETUPS)
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--json", type=Path, help="also write the reports here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        raise SystemExit(f"bench.scale_out: unknown setups {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    workload = build_workload(args)
    reports = []
    replicated = [s for s in setups if s != "single"]
    if replicated:
        with ray_serve(args) as url:
            reports += [run_replicas(url, routing, workload, args) for routing in replicated]
    if "single" in setups:
        reports.append(run_single(workload, args))
    text = format_report(reports, args)
    print(text)
    if args.json is not None:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "text": text}
        payload["reports"] = [asdict(r) | {"hit_rate": r.hit_rate} for r in reports]
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
