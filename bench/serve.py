"""Serving benchmark of any OpenAI-compatible server, at several fixed concurrencies.

`python -m bench.serve --url http://127.0.0.1:8000 --concurrency 1,8,32` streams completions
(`POST /v1/completions`, `stream: true`) of a fixed, seeded set of random-word prompts. At
each concurrency level exactly that many requests are in flight until the level's requests
are done; the next level starts after the previous one finished. Per level it reports
request throughput, output tokens/s, time to first token (TTFT), time per output token
after the first (TPOT) and inter-token latency (ITL, the gaps between streamed chunks),
each as mean, p50 and p99, plus the errors.

Output tokens come from the `usage` of the final chunk (`stream_options.include_usage`)
when the server sends it, else each content chunk counts as one token. Nothing here is
specific to pagedserve, so the same command measures a peer server side by side;
`--ignore-eos` (a vLLM extension that not every server accepts) makes every request
generate exactly `--max-tokens` tokens.

`--workload grounded` sends input-grounded prompts instead (`bench.grounded`: edit,
rename, extract, convert, repeat over a few hundred tokens of source), the work that
speculative decoding by prompt lookup speeds up. Where the server exports vLLM's
`vllm:spec_decode_*` counters on /metrics (pagedserve and vLLM with speculation on), each
level also reports the acceptance length: tokens per verification, 1 + accepted draft
tokens / drafts. Its requests send `repetition_penalty: 1.0` unless `--repetition-penalty`
says otherwise: a penalty on the tokens seen fights the copying the tasks ask for, a model's
generation config may set one (SmolLM2-135M-Instruct's: 1.1), and llama-server applies
none by default, so pure greedy decoding is what compares servers on copying.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.grounded import grounded_prompts
from bench.tables import format_table, positive_ints

_COMMON_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death"
)
WORDS = _COMMON_WORDS.split()
ERROR_SAMPLES = 3
# What the grounded workload sends as repetition_penalty by default: none (see the module's
# docstring).
GROUNDED_REPETITION_PENALTY = 1.0
# vLLM's counters of speculative decoding, as exposed (the acceptance length's inputs).
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


# The line ends of server-sent events (CR, LF, CRLF), and no others: httpx's `aiter_lines`
# also splits at U+0085, U+2028 and U+2029, which a server's JSON may hold raw.
_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each `data:` line of a server-sent event stream, in order."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _LINE_END.split(pending + text)
        for line in lines:
            if line.startswith("data:"):
                yield line.removeprefix("data:").strip()
    if pending.startswith("data:"):
        yield pending.removeprefix("data:").strip()


@dataclass(slots=True)
class RequestResult:
    """One streamed request: `chunk_times` are seconds since its start, one per content chunk;
    `output_tokens` is the server's count when it sent usage, else the number of chunks."""

    ok: bool
    latency: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None


@dataclass(slots=True)
class Stats:
    """Mean, median and 99th percentile of one latency, in milliseconds (None: no samples)."""

    mean: float | None
    p50: float | None
    p99: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        if not seconds:
            return cls(None, None, None)
        ms = np.asarray(seconds) * 1000.0
        return cls(float(ms.mean()), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)))


@dataclass(slots=True)
class LevelReport:
    """The summary of one concurrency level; throughputs count successful requests only."""

    concurrency: int
    requests: int
    successes: int
    errors: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    output_tokens: int
    usage_reported: int
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    error_samples: list[str]
    # Tokens per verification (1 + accepted / drafts); None where the server reports none.
    acceptance_length: float | None = None


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    """`count` distinct prompts of `words` random common words each, the same for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(count)]


def summarize(concurrency: int, results: Sequence[RequestResult], duration: float) -> LevelReport:
    """Aggregate one level's requests; TPOT is per request, (latency - TTFT) / (tokens - 1)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.chunk_times[0] for r in ok]
    tpots = [
        (r.latency - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
    ]
    itls = [float(gap) for r in ok for gap in np.diff(r.chunk_times)]
    tokens = sum(r.output_tokens for r in ok)
    errors = [r.error or "unknown error" for r in results if not r.ok]
    return LevelReport(
        concurrency=concurrency,
        requests=len(results),
        successes=len(ok),
        errors=len(errors),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=tokens / duration,
        output_tokens=tokens,
        usage_reported=sum(r.usage_reported for r in ok),
        ttft_ms=Stats.of(ttfts),
        tpot_ms=Stats.of(tpots),
        itl_ms=Stats.of(itls),
        e2e_ms=Stats.of([r.latency for r in ok]),
        error_samples=sorted(set(errors))[:ERROR_SAMPLES],
    )


class Benchmark:
    """Streams completions from `base_url` (the server root, without /v1) with one client."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, args: argparse.Namespace) -> None:
        self.client = client
        self.base_url = base_url
        self.args = args

    async def first_model(self) -> str:
        """The first model of /v1/models, for servers that serve one model."""
        response = await self.client.get(f"{self.base_url}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])

    def body(self, model: str, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": self.args.max_tokens,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        penalty = repetition_penalty(self.args)
        if penalty is not None:
            body["repetition_penalty"] = penalty
        return body

    async def request(self, model: str, prompt: str) -> RequestResult:
        """One streamed completion; every failure becomes an error result, never an exception."""
        start = time.perf_counter()
        result = RequestResult(ok=False, latency=0.0)
        try:
            async with self.client.stream(
                "POST", f"{self.base_url}/v1/completions", json=self.body(model, prompt)
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:200]
                    result.error = f"HTTP {response.status_code}: {detail}"
                else:
                    await self._read_stream(response, start, result)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        result.latency = time.perf_counter() - start
        if result.error is None and not result.chunk_times:
            result.error = "the stream ended without any output text"
        result.ok = result.error is None
        return result

    @staticmethod
    async def _read_stream(response: httpx.Response, start: float, result: RequestResult) -> None:
        async for data in sse_data(response):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"stream error: {chunk['error']}"[:200]
                return
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                result.chunk_times.append(time.perf_counter() - start)
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                result.output_tokens = int(usage["completion_tokens"])
                result.usage_reported = True
        if not result.usage_reported:
            result.output_tokens = len(result.chunk_times)

    async def spec_counters(self) -> tuple[float, float] | None:
        """(drafts, accepted draft tokens) from the server's /metrics, summed over
        models; None where it exports no `vllm:spec_decode_*` counters."""
        try:
            response = await self.client.get(f"{self.base_url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        totals = {SPEC_DRAFTS: 0.0, SPEC_ACCEPTED: 0.0}
        found = False
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
                    found = True
        return (totals[SPEC_DRAFTS], totals[SPEC_ACCEPTED]) if found else None

    async def level(self, model: str, concurrency: int, prompts: Sequence[str]) -> LevelReport:
        """Run `prompts` with exactly `concurrency` in flight (fewer only at the end)."""
        pending = iter(prompts)  # shared: each worker takes the next prompt when it is free
        results: list[RequestResult] = []

        async def worker() -> None:
            for prompt in pending:
                results.append(await self.request(model, prompt))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summarize(concurrency, results, time.perf_counter() - start)


async def run(args: argparse.Namespace) -> tuple[str, list[LevelReport]]:
    """Warm up, then run each concurrency level in turn; return the model and the reports."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency), max_keepalive_connections=None)
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout, connect=10.0)
    ) as client:
        bench = Benchmark(client, args.url.rstrip("/").removesuffix("/v1"), args)
        model = args.model or await bench.first_model()
        counts = [args.num_requests or max(2 * c, 8) for c in args.concurrency]
        # Every request of the run gets its own prompt, so no level hits another's prefixes.
        total = args.warmup + sum(counts)
        if args.workload == "grounded":
            prompts = grounded_prompts(total, args.seed)
        else:
            prompts = make_prompts(total, args.prompt_words, args.seed)
        for prompt in prompts[: args.warmup]:
            warmup = await bench.request(model, prompt)
            if not warmup.ok:
                raise SystemExit(f"bench.serve: the warm-up request failed: {warmup.error}")
        reports = []
        start = args.warmup
        for concurrency, count in zip(args.concurrency, counts, strict=True):
            level_prompts = prompts[start : start + count]
            start += count
            before = await bench.spec_counters()
            report = await bench.level(model, concurrency, level_prompts)
            after = await bench.spec_counters()
            if before is not None and after is not None and after[0] > before[0]:
                report.acceptance_length = 1 + (after[1] - before[1]) / (after[0] - before[0])
            reports.append(report)
            print(f"concurrency {concurrency}: done", file=sys.stderr, flush=True)
        return model, reports


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_report(reports: Sequence[LevelReport]) -> str:
    """One row per concurrency level; latencies in milliseconds."""
    headers = ["conc", "reqs", "errors", "req/s", "out tok/s"] + [
        f"{metric} {stat}" for metric in ("TTFT", "TPOT", "ITL") for stat in ("mean", "p50", "p99")
    ]
    headers.append("accept len")
    rows = [
        [str(r.concurrency), str(r.requests), str(r.errors), f"{r.request_throughput:.2f}"]
        + [_cell(r.output_throughput)]
        + [
            _cell(value)
            for stats in (r.ttft_ms, r.tpot_ms, r.itl_ms)
            for value in (stats.mean, stats.p50, stats.p99)
        ]
        + ["-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}"]
        for r in reports
    ]
    return format_table(headers, rows)


def repetition_penalty(args: argparse.Namespace) -> float | None:
    """The repetition_penalty the requests send; None: none is sent."""
    if args.repetition_penalty is None and args.workload == "grounded":
        return GROUNDED_REPETITION_PENALTY
    return args.repetition_penalty


def write_json(
    path: Path, args: argparse.Namespace, model: str, reports: Sequence[LevelReport]
) -> None:
    report = {
        "url": args.url,
        "model": model,
        "max_tokens": args.max_tokens,
        "workload": args.workload,
        "prompt_words": args.prompt_words,
        "temperature": args.temperature,
        "repetition_penalty": repetition_penalty(args),
        "ignore_eos": args.ignore_eos,
        "levels": [asdict(r) for r in reports],
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_plot(path: Path, model: str, reports: Sequence[LevelReport]) -> None:
    """Output throughput (left) and p50 latencies (right) against concurrency, on log2 axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r.concurrency for r in reports]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(levels, [r.output_throughput for r in reports], "o-")
    left.set_ylabel("output tokens/s")
    left.set_title("throughput")
    for label, name in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms")):
        values = [getattr(r, name).p50 for r in reports]
        right.plot(levels, [np.nan if v is None else v for v in values], "o-", label=label)
    right.set_ylabel("p50 latency, ms")
    right.set_yscale("log")
    right.set_title("latency")
    right.legend()
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.set_xlabel("concurrency")
    figure.suptitle(f"bench.serve: {model}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _positive_int(text: str) -> int:
    (value,) = positive_ints(text)
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Streaming serving benchmark of an OpenAI-compatible server.",
    )
    parser.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name; default: the first of /v1/models")
    parser.add_argument(
        "--concurrency", type=positive_ints, default=[1, 8, 32], help="levels, e.g. 1,8,32"
    )
    parser.add_argument(
        "--num-requests", type=_positive_int, help="requests per level; default: max(2c, 8)"
    )
    parser.add_argument("--max-tokens", type=_positive_int, default=128)
    parser.add_argument(
        "--workload",
        choices=["random", "grounded"],
        default="random",
        help="random: prompts of random words; grounded: edit, rename, extract, convert "
        "and repeat tasks over a source (bench.grounded); default: random",
    )
    parser.add_argument(
        "--prompt-words", type=_positive_int, default=160, help="random workload only"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        help="sent as repetition_penalty; default: 1.0 with --workload grounded, else not "
        "sent (the server's default)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (vLLM-style servers only)"
    )
    parser.add_argument(
        "--warmup", type=_positive_int, default=1, help="untimed requests first (at least 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY"
    )
    parser.add_argument("--json", type=Path, help="write the report to this file")
    parser.add_argument("--plot", type=Path, help="write a PNG plot to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    model, reports = asyncio.run(run(args))
    print(f"model {model}, max_tokens {args.max_tokens}, prompt words {args.prompt_words}")
    print(format_report(reports))
    if args.json is not None:
        write_json(args.json, args, model, reports)
    if args.plot is not None:
        write_plot(args.plot, model, reports)


if __name__ == "__main__":
    main()
