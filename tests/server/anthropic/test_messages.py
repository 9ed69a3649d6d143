"""Anthropic's Messages API on a live server with the tiny model: the `anthropic` SDK's
own types, the stream's event shapes, count_tokens, and bad inputs as 4xx in Anthropic's
error envelope that leave nothing running or held. The real default model's tool round
trip is in test_agent_clients.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.conftest import live_server, tiny_config, wait_until_idle

KEY = "sk-ant-test"
ASK = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}  # the SDK has no temperature argument; the API takes one
CITY = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ONE_CALL = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", api_key=KEY, max_model_len=2048
    )
    with live_server(config) as url:
        yield url


@pytest.fixture(scope="module")
def api(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def post(server: str, body: dict[str, Any], path: str = "messages") -> httpx.Response:
    return httpx.post(f"{server}/v1/{path}", json=body, headers={"x-api-key": KEY}, timeout=60)


def events(server: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed reply's events as (event name, data)."""
    response = post(server, {**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [frame for frame in response.text.split("\n\n") if frame]
    parsed = []
    for frame in frames:
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        parsed.append((name, data))
    return parsed


def test_create_returns_the_sdks_message(api: anthropic.Anthropic) -> None:
    reply = api.messages.create(
        model="tiny", max_tokens=6, messages=ASK, system="Be brief.", extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "tiny"
    assert reply.id.startswith("msg_")
    [block] = reply.content
    assert block.type == "text" and block.text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 0 < reply.usage.output_tokens <= 6
    # the system prompt is part of the prompt
    plain = api.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    counted = api.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    assert counted.input_tokens > plain


def test_stream_events_are_anthropics_and_match_create(
    server: str, api: anthropic.Anthropic
) -> None:
    body = {"model": "tiny", "max_tokens": 8, "messages": ASK, **GREEDY}
    names = [name for name, _ in events(server, body)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[3:-3]) == {"content_block_delta"}
    created = api.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY)
    with api.messages.stream(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == created.content[0].text == streamed.content[0].text
    assert streamed.stop_reason == created.stop_reason
    assert streamed.usage.output_tokens == created.usage.output_tokens
    total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    assert total == created.usage.input_tokens + created.usage.cache_read_input_tokens


def test_a_stop_sequence_ends_the_reply(api: anthropic.Anthropic) -> None:
    whole = api.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY)
    text = whole.content[0].text
    stop = text[2:4]
    cut = api.messages.create(
        model="tiny", max_tokens=8, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_and_its_result(api: anthropic.Anthropic, stream: bool) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", max_tokens=200, tools=[CITY], tool_choice=ONE_CALL, extra_body=GREEDY
    )
    if stream:
        with api.messages.stream(messages=ASK, **kwargs) as events_:
            kinds = {event.type for event in events_}
            reply = events_.get_final_message()
        assert "input_json" in kinds  # the SDK's event for an input_json_delta
    else:
        reply = api.messages.create(messages=ASK, **kwargs)
    assert reply.stop_reason == "tool_use"
    [use] = reply.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city"} and len(use.input["city"]) <= 8
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}
    conversation = [*ASK, reply.to_param(), {"role": "user", "content": [result]}]
    answer = api.messages.create(
        model="tiny", max_tokens=4, messages=conversation, tools=[CITY], extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the call and its result are in the prompt, as count_tokens counts it
    counted = api.messages.count_tokens(model="tiny", messages=conversation, tools=[CITY])
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    asked = api.messages.count_tokens(model="tiny", messages=ASK, tools=[CITY]).input_tokens
    assert counted.input_tokens > asked + len(json.dumps(use.input))


def test_tool_choice_none_leaves_the_tools_out(api: anthropic.Anthropic) -> None:
    without = api.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    none = {"type": "none"}
    counted = api.messages.count_tokens(model="tiny", messages=ASK, tools=[CITY], tool_choice=none)
    assert counted.input_tokens == without
    offered = api.messages.count_tokens(model="tiny", messages=ASK, tools=[CITY]).input_tokens
    assert offered > without


def test_both_key_headers_are_accepted(server: str) -> None:
    body = {"model": "tiny", "max_tokens": 1, "messages": ASK}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(f"{server}/v1/messages", json=body, headers=headers).status_code == 200
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": f"Bearer {KEY}x"}):
        response = httpx.post(f"{server}/v1/messages", json=body, headers=headers)
        assert_anthropic_error(response, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="sk-wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=1, messages=ASK
        )
    # the OpenAI endpoints take the Anthropic header too
    chat = {"model": "tiny", "max_tokens": 1, "messages": ASK}
    assert post(server, chat, "chat/completions").status_code == 200


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
TEXT = {"type": "text", "text": "Hi"}
CALLED = [*ASK, {"role": "assistant", "content": [CALL]}]

ASSISTANT_CALL = {"role": "assistant", "content": [CALL]}
BAD_INPUT_CALL = {"role": "assistant", "content": [{**CALL, "input": "x"}]}
IMAGE = {"type": "image", "source": {}}


def sent(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"messages": list(messages)}


# case -> (changes to a valid body, words its error message holds); all are 400s but
# the unknown model's 404
BAD_REQUESTS: dict[str, tuple[dict[str, Any], str]] = {
    "max_tokens string": ({"max_tokens": "5"}, "max_tokens"),
    "max_tokens missing": ({"max_tokens": None}, "max_tokens"),
    "temperature word": ({"temperature": "hot"}, "temperature"),
    "negative temperature": ({"temperature": -1}, "temperature"),
    "empty stop sequence": ({"stop_sequences": [""]}, "stop_sequences"),
    "content number": (sent({"role": "user", "content": 5}), "messages[0].content"),
    "system role": (sent({"role": "system", "content": "x"}), "messages[0].role"),
    "image block": (sent(user(IMAGE)), "'image' content blocks are not supported"),
    "block without type": (sent(user({"text": "x"})), "messages[0].content[0]"),
    "text block typo": (sent(user({**TEXT, "txet": "x"})), "content[0].txet: unrecognized"),
    "tool_use from the user": (sent(user(CALL)), "a user message cannot hold tool_use"),
    "tool_result without its tool_use": (
        sent(user(RESULT)),
        "messages[0].content[0].tool_use_id: 'toolu_1' answers no tool_use",
    ),
    "tool_use without its result": (sent(*ASK, ASSISTANT_CALL, user(TEXT)), "none answers toolu_1"),
    "tool input not an object": (
        sent(*ASK, BAD_INPUT_CALL, user(RESULT)),
        "messages[1].content[0].input",
    ),
    "prefilled reply": (sent(*ASK, {"role": "assistant", "content": "The"}), "continuing"),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "server tools are not available",
    ),
    "tool_choice names no tool": (
        {"tools": [CITY], "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice.name",
    ),
    "tool_choice without tools": ({"tool_choice": {"type": "any"}}, "tool_choice"),
    "budget above max_tokens": (
        {"thinking": {"type": "enabled", "budget_tokens": 2048}},
        "thinking.budget_tokens",
    ),
    "refused field": ({"container": "c"}, "container: not supported"),
    "unknown field": ({"frobnicate": 1}, "frobnicate: unrecognized"),
    "effort": ({"output_config": {"effort": "high"}}, "output_config.effort: not supported"),
    "unknown model": ({"model": "claude-opus-4-5"}, "does not exist"),
    "too long": (sent({"role": "user", "content": "fox " * 3000}), "maximum context length"),
}


CONVERSATION_CASES = (
    "image block",
    "tool_result without its tool_use",
    "tool_use without its result",
    "server tool",
    "unknown field",
    "unknown model",
)


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_are_anthropic_errors(server: str, case: str) -> None:
    changes, words = BAD_REQUESTS[case]
    status, kind = (
        (404, "not_found_error") if case == "unknown model" else (400, "invalid_request_error")
    )
    body = {"model": "tiny", "max_tokens": 4, "messages": ASK, **changes}
    body = {key: value for key, value in body.items() if value is not None}
    for stream in (False, True):
        response = post(server, {**body, "stream": stream})
        assert_anthropic_error(response, status, kind)
        assert words in response.json()["error"]["message"]
    if case in CONVERSATION_CASES:  # count_tokens reads the conversation as create does
        conversation = {key: value for key, value in body.items() if key != "max_tokens"}
        assert_anthropic_error(post(server, conversation, "messages/count_tokens"), status, kind)
    metrics = wait_until_idle(server)
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    assert metrics["pagedserve_num_requests_running"] == 0


def test_malformed_json_is_an_anthropic_error(server: str) -> None:
    response = httpx.post(
        f"{server}/v1/messages", content=b'{"model": ', headers={"x-api-key": KEY}
    )
    assert_anthropic_error(response, 400, "invalid_request_error")


def test_a_stream_closed_mid_way_frees_everything(server: str) -> None:
    body = {"model": "tiny", "max_tokens": 400, "messages": ASK, "stream": True}
    with httpx.stream(
        "POST", f"{server}/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
    metrics = wait_until_idle(server)
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    assert metrics["pagedserve_num_requests_running"] == 0


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert body["request_id"] == response.headers["x-request-id"]
