"""Bad requests get the right status and OpenAI's error body; the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import RAY_INGRESS, SERVER, client, served, tiny_config

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module", params=[SERVER, RAY_INGRESS])
def keyed_server(
    tiny_model_paths: dict[str, Path], request: pytest.FixtureRequest
) -> Iterator[str]:
    """The tiny Llama requiring `KEY`, served by a live server and behind the Ray Serve
    ingress in turn."""
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny", api_key=KEY)
    with served(config, request.param) as url:
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
    "ten thousand stops": (completion(stop=[f"s{i}" for i in range(10_000)]), 400, "stop"),
    "a huge stop string": (completion(stop=["x" * 10_000]), 400, "stop"),
    "seed beyond 64 bits": (completion(seed=2**70), 400, "seed"),
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
    "echo with logprobs, streaming": (
        completion(echo=True, logprobs=1, stream=True),
        400,
        "echo",
    ),
    "max_tokens 0 without echo": (completion(max_tokens=0), 400, "max_tokens"),
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
    # Issue 13: nothing is silently dropped, and bad inputs are 4xx.
    "lone surrogate in prompt": (
        ("completions", b'{"model": "tiny", "prompt": "\\ud800 broken surrogate"}'),
        400,
        "prompt",
    ),
    "lone surrogate in a message": (
        (
            "chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
        ),
        400,
        "messages[0].content",
    ),
    "lone surrogate in a key": (("completions", b'{"model": "tiny", "\\ud800": 1}'), 400, None),
    "unknown field": (completion(temprature=0.5), 400, "temprature"),
    "unknown nested field": (
        chat(messages=[{"role": "user", "content": "Hi", "x": 1}]),
        400,
        "messages[0].x",
    ),
    "suffix": (completion(suffix="!"), 400, "suffix"),
    "prompt_logprobs above the cap": (completion(prompt_logprobs=21), 400, "prompt_logprobs"),
    "prompt_logprobs streaming": (
        completion(prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
    ),
    "negative prompt_logprobs in chat": (chat(prompt_logprobs=-1), 400, "prompt_logprobs"),
    "best_of below n": (completion(n=4, best_of=2), 400, "best_of"),
    "best_of above n": (completion(n=1, best_of=2), 400, "best_of"),
    "best_of in chat": (chat(best_of=2), 400, "best_of"),
    "modalities": (chat(modalities=["text", "audio"]), 400, "modalities"),
    "audio output": (chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    "prediction": (chat(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    "audio part": (
        chat(messages=user_says([{"type": "input_audio", "input_audio": {"data": ""}}])),
        400,
        "messages[0].content[0].type",
    ),
    "user without content": (chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    "system with null content": (
        chat(messages=[{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]),
        400,
        "messages[0].content",
    ),
    "developer without content": (
        chat(messages=[{"role": "developer"}]),
        400,
        "messages[0].content",
    ),
    "stream_options without stream": (
        completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    "chat stream_options with stream false": (
        chat(stream=False, stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    "unknown stream_options field": (
        completion(stream=True, stream_options={"continuous_usage_stats": True}),
        400,
        "stream_options.continuous_usage_stats",
    ),
    "negative max_completion_tokens": (
        chat(max_completion_tokens=-1),
        400,
        "max_completion_tokens",
    ),
    "logit_bias key not an id": (completion(logit_bias={"the": 5}), 400, "logit_bias"),
    "logit_bias negative id": (chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    "logit_bias id out of vocab": (completion(logit_bias={"100000": 5}), 400, "logit_bias"),
    "logit_bias value above 100": (chat(logit_bias={"5": 100.5}), 400, "logit_bias"),
    "logit_bias value a string": (completion(logit_bias={"5": "high"}), 400, "logit_bias.5"),
    "logit_bias a list": (chat(logit_bias=[5]), 400, "logit_bias"),
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


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (completion(suffix="!"), "suffix: not supported: insertion"),
        (completion(n=2, best_of=3), "best_of: above n (2) is not supported"),
        (chat(modalities=["audio"]), "modalities: not supported"),
        (chat(messages=user_says([{"type": "image_url"}])), "'image_url' content parts are not"),
        (completion(logprobs=21), "logprobs must be <= 20: more alternatives are not supported"),
        (completion(temprature=0.5), "temprature: unrecognized request argument"),
        (chat(max_completion_tokens=0), "max_completion_tokens must be >= 1"),
    ],
)
def test_refusals_say_why(keyed_server: str, call: tuple[str, Any], words: str) -> None:
    path, body = call
    response = httpx.post(f"{keyed_server}/v1/{path}", json=body, headers=AUTH)
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]


def test_no_op_and_null_fields_are_accepted(keyed_server: str) -> None:
    api = client(keyed_server, api_key=KEY)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant"},  # an assistant turn may come without content
        {"role": "user", "content": "Again"},
    ]
    no_ops = dict(user="u-1", metadata={"k": "v"}, store=False, service_tier="auto")
    result = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        audio=None,
        **no_ops,
        extra_body={"safety_identifier": "s", "best_of": None},
    )
    assert result.choices[0].message.role == "assistant"
    plain = api.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    same = api.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, temperature=0, user="u-1", suffix=None, best_of=1
    )
    assert same.choices[0].text == plain.choices[0].text


def test_tokenize_endpoints_need_the_key(keyed_server: str) -> None:
    for path, body in (("tokenize", {"prompt": "Hi"}), ("detokenize", {"tokens": [1]})):
        assert_openai_error(httpx.post(f"{keyed_server}/{path}", json=body), 401, None)
        assert httpx.post(f"{keyed_server}/{path}", json=body, headers=AUTH).status_code == 200
