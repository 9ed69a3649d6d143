"""32 concurrent greedy streams of the real default model, in the default configuration,
get token for token what the same requests get one at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from server.config import ServeConfig
from tests.server.conftest import client, live_server
from tests.support.default_model import DEFAULT_MODEL_SETTINGS

pytestmark = pytest.mark.slow
TOPICS = ["the sea", "a library", "winter", "trains", "bread", "a violin", "the moon", "rain"]
PROMPTS = [f"Write two sentences about {topic}, version {i}." for i in range(4) for topic in TOPICS]


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    with live_server(ServeConfig(**DEFAULT_MODEL_SETTINGS)) as url:
        yield url


def request(prompt: str) -> dict[str, object]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": True,
    }


def test_32_concurrent_streams_equal_one_at_a_time(default_server: str) -> None:
    api = client(default_server)
    sequential = []
    for prompt in PROMPTS:
        choice = api.chat.completions.create(**request(prompt)).choices[0]
        sequential.append([(t.token, t.logprob) for t in choice.logprobs.content])
    assert asyncio.run(_stream_all(f"{default_server}/v1")) == sequential


async def _stream_all(base_url: str) -> list[list[tuple[str, float]]]:
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    async def stream(prompt: str) -> list[tuple[str, float]]:
        tokens = []
        async for chunk in await api.chat.completions.create(**request(prompt), stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += [(t.token, t.logprob) for t in chunk.choices[0].logprobs.content]
        return tokens

    return list(await asyncio.gather(*(stream(prompt) for prompt in PROMPTS)))
