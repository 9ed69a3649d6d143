"""The real default model (SmolLM2-135M-Instruct) answers real questions over the API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.model.loader import DEFAULT_MODEL_GENERATION_CONFIG, resolve_model_folder
from server.config import ServeConfig
from tests.server.conftest import client, live_server
from tests.support.default_model import DEFAULT_MODEL_SETTINGS

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Name the capital of France."}]
# The README's first curl: no sampling field at all.
README_BODY = {"model": "SmolLM2-135M-Instruct", "messages": QUESTION}


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    # The shipped defaults (int4, compiled), with the KV cache of test_invariance's server
    # so that both load one compiled graph. Sampled requests draw from one seeded
    # generator: the same answers on every run.
    with live_server(ServeConfig(**DEFAULT_MODEL_SETTINGS, seed=0)) as url:
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


def test_the_default_model_ships_its_sampling_defaults(default_server: str) -> None:
    folder = Path(resolve_model_folder("default")[0])
    written = json.loads((folder / "generation_config.json").read_text())
    assert written.items() >= DEFAULT_MODEL_GENERATION_CONFIG.items()
    [model] = client(default_server).models.list().data
    assert model.model_extra["default_sampling_params"] == {
        "temperature": 0.2,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    }


def test_the_readme_request_gets_a_short_answer_at_the_defaults(default_server: str) -> None:
    url = f"{default_server}/v1/chat/completions"
    for _ in range(4):
        reply = httpx.post(url, json=README_BODY, timeout=120).json()
        [choice] = reply["choices"]
        assert "Paris" in choice["message"]["content"]
        assert choice["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] <= 64
