"""A replica's app takes the prompt the ingress rendered (token ids and block hashes) from
the forwarded request instead of rendering, tokenizing and hashing it again; an engine
request with n > 1 hashes its prompt once. No Ray: the app runs in-process, as a replica
runs it (`call_app` over its lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import cache.block
from engine import LLM, SamplingParams
from engine.request.intake import RenderedPrompt
from scale_out.forwarding import ForwardedRequest, call_app
from server.app import build_app
from tests.server.conftest import tiny_config

BLOCK = 16
TOKENS = tuple(range(5, 5 + 3 * BLOCK + 4))  # three full blocks and a partial one


@contextlib.asynccontextmanager
async def replica_app(model: Path) -> AsyncIterator[Any]:
    app = build_app(tiny_config(model, block_size=BLOCK, served_model_name="tiny"))
    async with app.router.lifespan_context(app):
        model = app.state.server.models.first
        while model.llm is None:
            assert model.load_error is None, model.load_error
            await asyncio.sleep(0.05)
        yield app


async def post(app: Any, path: str, body: dict[str, Any], prompt: RenderedPrompt | None) -> Any:
    headers = ((b"content-type", b"application/json"),)
    request = ForwardedRequest("POST", path, headers=headers, body=json.dumps(body).encode())
    if prompt is not None:
        request = ForwardedRequest(**{**_fields(request), "prompt": prompt})
    chunks = [
        message.get("body", b"")
        async for message in call_app(app, request)
        if message["type"] == "http.response.body"
    ]
    return json.loads(b"".join(chunks))


def _fields(request: ForwardedRequest) -> dict[str, Any]:
    return {name: getattr(request, name) for name in ForwardedRequest.__dataclass_fields__}


def test_the_replica_runs_the_forwarded_prompt_and_starts_from_its_hashes(
    tiny_model_paths: dict[str, Path],
) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    # Hashes no engine would compute for these tokens: a hit on them proves they were used.
    made_up = RenderedPrompt(TOKENS, (11, 12, 13), BLOCK)
    other_size = RenderedPrompt(TOKENS, (21, 22, 23), BLOCK * 2)

    async def scenario() -> list[Any]:
        async with replica_app(tiny_model_paths["llama"]) as app:
            return [
                await post(app, "/v1/chat/completions", chat, made_up),
                await post(app, "/v1/completions", completion, made_up),
                await post(app, "/v1/completions", completion, None),
                await post(app, "/v1/completions", {**completion, "prompt": list(TOKENS)}, None),
                await post(app, "/v1/completions", completion, other_size),
            ]

    first, again, plain, same_tokens, ignored = asyncio.run(scenario())
    # The forwarded token ids ran, not the body's one-word prompt or conversation.
    assert first["usage"]["prompt_tokens"] == len(TOKENS)
    assert again["usage"]["prompt_tokens"] == len(TOKENS)
    assert plain["usage"]["prompt_tokens"] < len(TOKENS)
    # Its blocks were cached under the forwarded hashes: the same forwarded prompt hits
    # them; the same tokens hashed by the engine itself do not.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert same_tokens["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Hashes made at another block size are dropped; the engine hashes the tokens itself.
    assert ignored["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK


def test_n_samples_hash_their_prompt_once(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_model_paths["llama"]), dtype="float32", kv_cache_memory="16MiB")
    hashed: list[int] = []
    real = cache.block.hash_block
    monkeypatch.setattr(cache.block, "hash_block", lambda *args: hashed.append(1) or real(*args))
    params = SamplingParams(n=4, max_tokens=2, temperature=1.0, seed=1)
    [output] = llm.generate([list(TOKENS)], params)
    assert len(output.outputs) == 4
    # Three prompt blocks once, not four times (no sample fills a fourth block).
    assert len(hashed) == 3
