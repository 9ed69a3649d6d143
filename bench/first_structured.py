"""What a server's first structured-output request does to the streams already running.

`python -m bench.first_structured --url URL` runs `--streams` streamed completions (greedy,
end of sequence ignored) against a running server, and once they decode sends its first
structured request: a chat completion whose `response_format` is a JSON schema (an enum,
a nested object, a list), not streamed, once every stream has had `--warmup-chunks`
chunks (`--plain`: the same request without the schema, for a baseline). It reports each
stream's mean gap between chunks before the request, the longest gap that overlapped it
and their ratio, and the request's own latency.

Start the server fresh, so that this is its first constrained request, on an empty
Inductor cache if you want to see a just-in-time compile (there should be none):

    PAGEDSERVE_CACHE=$(mktemp -d) pagedserve serve --config configs/default.yaml --port 8011
    python -m bench.first_structured --url http://127.0.0.1:8011
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Sequence

import httpx

from bench.serve import sse_data
from bench.tables import format_table

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "kind": {"enum": ["capital", "port", "village"]},
        "location": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 30}},
            "required": ["country"],
        },
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}},
    },
    "required": ["city", "kind", "location", "landmarks"],
    "additionalProperties": False,
}


async def stream(
    client: httpx.AsyncClient, url: str, model: str, index: int, times: list[float]
) -> None:
    """One endless greedy stream; appends each text chunk's arrival time to `times`."""
    body = {
        "model": model,
        "prompt": f"Stream number {index}: tell a long story about the sea.",
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for data in sse_data(response):
            if '"text"' in data:
                times.append(time.perf_counter())


async def structured(client: httpx.AsyncClient, url: str, model: str, plain: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
        "max_tokens": 96,
        "temperature": 0,
    }
    if not plain:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
        }
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def gaps(times: Sequence[float]) -> list[tuple[float, float]]:
    """(start, length) of each interval between consecutive chunks."""
    return [(a, b - a) for a, b in itertools.pairwise(times)]


async def run(args: argparse.Namespace) -> list[list[str]]:
    async with httpx.AsyncClient(timeout=None) as client:
        models = (await client.get(f"{args.url}/v1/models")).json()
        model = models["data"][0]["id"]
        times: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [
            asyncio.create_task(stream(client, args.url, model, i, times[i]))
            for i in range(args.streams)
        ]
        while min(len(t) for t in times) < args.warmup_chunks:
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        reply = await structured(client, args.url, model, args.plain)
        end = time.perf_counter()
        await asyncio.sleep(args.after)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    content = reply["choices"][0]["message"]["content"]
    if not args.plain:
        json.loads(content)  # the reply must be the JSON the schema asks for
    rows = []
    for index, stream_times in enumerate(times):
        intervals = gaps(stream_times)
        before = [length for at, length in intervals if at + length < start]
        during = [length for at, length in intervals if at <= end and at + length >= start]
        mean = statistics.mean(before[len(before) // 2 :])  # the steady half
        longest = max(during)
        rows.append(
            [
                str(index),
                f"{1000 * mean:.1f}",
                f"{1000 * longest:.1f}",
                f"{longest / mean:.1f}x",
                f"{1000 * (end - start):.0f}",
            ]
        )
    print(f"structured reply: {content}")
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument(
        "--warmup-chunks", type=int, default=32, help="chunks every stream gets first"
    )
    parser.add_argument("--after", type=float, default=1.0, help="seconds of streams after")
    parser.add_argument(
        "--plain", action="store_true", help="the same chat request without a schema (a baseline)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    rows = asyncio.run(run(parse_args(argv)))
    headers = ["stream", "mean gap ms", "longest gap ms", "ratio", "structured request ms"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
