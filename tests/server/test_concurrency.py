"""Concurrent streams get exactly the texts the same prompts get one at a time."""

from __future__ import annotations

import asyncio

import openai

from tests.server.conftest import BOTH_STEP_ORDERS, client

pytestmark = BOTH_STEP_ORDERS

PROMPTS = [
    f"{opening} {i}"
    for i, opening in enumerate(
        [
            "The quick brown fox",
            "Paged attention keeps",
            "Continuous batching schedules",
            "def main():",
            "Héllo wörld, naïve café",
            "東京 and 😀",
            "The lazy dog",
            "Keys and values in blocks",
        ]
        * 4
    )
]


def test_32_concurrent_streams_match_sequential_greedy(tiny_server: str) -> None:
    api = client(tiny_server)
    sequential = [
        api.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    concurrent = asyncio.run(_stream_all(f"{tiny_server}/v1"))
    assert concurrent == sequential


async def _stream_all(base_url: str) -> list[str]:
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    async def stream(prompt: str) -> str:
        chunks = await api.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in chunks])

    async with api:
        return await asyncio.gather(*(stream(p) for p in PROMPTS))
