"""The real default model (SmolLM2-135M-Instruct) answers real questions over the API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server.config import ServeConfig
from tests.server.conftest import client, live_server

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    config = ServeConfig(
        model="default",
        dtype="float32",
        device="cpu",
        kv_cache_memory="256MiB",
        max_model_len=1024,
        # The start-up profiling pass runs a batch this large; keep it short on a CPU.
        max_num_batched_tokens=256,
    )
    with live_server(config) as url:
        yield url


def test_capital_of_france_is_paris(default_server: str) -> None:
    api = client(default_server)
    [model] = api.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    answer = api.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=32, temperature=0
    )
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    streamed = api.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=32, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == answer.choices[0].message.content
    # The same conversation again is served from the prefix cache.
    again = api.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
