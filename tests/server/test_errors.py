"""Bad requests get the right status and OpenAI's error body; the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import client, live_server, tiny_config

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny", api_key=KEY)
    with live_server(config) as url:
        yield url


def completion(**changes: Any) -> tuple[str, dict[str, Any]]:
    return "completions", {**COMPLETION, **changes}


def chat(**changes: Any) -> tuple[str, dict[str, Any]]:
    return "chat/completions", {**CHAT, **changes}


def user_says(content: Any, role: str = "user") -> list[dict[str, Any]]:
    return [{"role": role, "content": content}]


# case -> ((path, JSON body or raw bytes), expected status, expected `param`)
BAD_REQUESTS: dict[str, tuple[tuple[str, Any], int, str | None]] = {
    "max_tokens string": (completion(max_tokens="5"), 400, "max_tokens"),
    "n bool": (completion(n=True), 400, "n"),
    "temperature word": (completion(temperature="hot"), 400, "temperature"),
    "prompt number": (completion(prompt=5), 400, "prompt"),
    "mixed prompt list": (completion(prompt=["a", [1]]), 400, "prompt"),
    "stop number": (completion(stop=5), 400, "stop"),
    "negative max_tokens": (completion(max_tokens=-1), 400, "max_tokens"),
    "zero n": (completion(n=0), 400, "n"),
    "huge n": (completion(n=10**6), 400, "n"),
    "negative temperature": (completion(temperature=-1), 400, "temperature"),
    "top_p above one": (completion(top_p=1.5), 400, "top_p"),
    "huge logprobs": (completion(logprobs=10**4), 400, "logprobs"),
    "huge max_tokens": (completion(max_tokens=10**9), 400, None),
    "too long prompt": (completion(prompt="fox " * 600), 400, None),
    "empty prompt": (completion(prompt=""), 400, None),
    "empty prompt list": (completion(prompt=[]), 400, "prompt"),
    "token id out of vocab": (completion(prompt=[10**6]), 400, "prompt"),
    "echo with logprobs": (completion(echo=True, logprobs=1), 400, "echo"),
    "missing prompt": (("completions", {"model": "tiny"}), 400, "prompt"),
    "missing model": (("completions", {"prompt": "Hi"}), 400, "model"),
    "unknown model": (completion(model="gpt-4"), 404, "model"),
    "malformed JSON": (("completions", b'{"model": "tiny", '), 400, None),
    "JSON array body": (("completions", b"[1, 2]"), 400, None),
    "no messages": (chat(messages=[]), 400, "messages"),
    "messages string": (chat(messages="Hi"), 400, "messages"),
    "unknown role": (chat(messages=user_says("Hi", role="robot")), 400, "messages[0].role"),
    "image part": (
        chat(messages=user_says([{"type": "image_url"}])),
        400,
        "messages[0].content[0].type",
    ),
    "top_logprobs alone": (chat(top_logprobs=2), 400, "top_logprobs"),
    "huge top_logprobs": (chat(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    "huge max_completion_tokens": (chat(max_completion_tokens=10**6), 400, None),
    "unknown chat model": (chat(model="nope"), 404, "model"),
    "streaming too long": (chat(stream=True, max_tokens=10**6), 400, None),
}


@pytest.mark.parametrize(("call", "status", "param"), BAD_REQUESTS.values(), ids=BAD_REQUESTS)
def test_bad_request_gets_openai_error(
    keyed_server: str, call: tuple[str, Any], status: int, param: str | None
) -> None:
    path, body = call
    url = f"{keyed_server}/v1/{path}"
    headers = {**AUTH, "Content-Type": "application/json"}
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers=headers)
    else:
        response = httpx.post(url, json=body, headers=headers)
    assert_openai_error(response, status, param)
    # The server keeps answering after every bad request.
    assert httpx.post(f"{keyed_server}/v1/completions", json=COMPLETION, headers=AUTH).is_success


@pytest.mark.parametrize("authorization", ["", "Bearer sk-wrong", KEY, f"Basic {KEY}"])
def test_api_key_is_required(keyed_server: str, authorization: str) -> None:
    for path, body in (completion(), chat()):
        response = httpx.post(
            f"{keyed_server}/v1/{path}", json=body, headers={"Authorization": authorization}
        )
        assert_openai_error(response, 401, None)
        assert response.headers["www-authenticate"] == "Bearer"


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    assert response.headers["x-request-id"]


def test_official_client_sees_typed_errors(keyed_server: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server, api_key="sk-wrong").models.list()
    api = client(keyed_server, api_key=KEY)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model="tiny", prompt="Hi", max_tokens=-3)
    assert api.models.list().data[0].id == "tiny"


def test_model_is_accepted_by_served_or_own_name(keyed_server: str) -> None:
    api = client(keyed_server, api_key=KEY)
    [card] = api.models.list().data
    assert card.id == "tiny"
    own_name = card.model_extra["root"]
    assert own_name == "llama"
    assert api.completions.create(model=own_name, prompt="Hi", max_tokens=1).model == "tiny"


def test_health_metrics_version_need_no_key(keyed_server: str) -> None:
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{keyed_server}{path}").status_code == 200
    assert httpx.get(f"{keyed_server}/v1/models").status_code == 401


def test_request_id_is_honoured_or_generated(keyed_server: str) -> None:
    mine = httpx.get(f"{keyed_server}/health", headers={"X-Request-Id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    generated = {httpx.get(f"{keyed_server}/health").headers["x-request-id"] for _ in range(2)}
    assert len(generated) == 2
    failed = httpx.post(f"{keyed_server}/v1/completions", json={}, headers={"X-Request-Id": "r1"})
    assert failed.headers["x-request-id"] == "r1"


def test_unknown_route_is_an_openai_404(keyed_server: str) -> None:
    response = httpx.get(f"{keyed_server}/v1/nothing", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
