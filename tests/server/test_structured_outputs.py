"""Structured outputs and tool calling with the official `openai` client against a live
server on the real default model: what comes back parses and validates, in every mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server.config import ServeConfig
from tests.server.conftest import client, live_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a fictional person as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # Eager: what these tests check is the grammar's hold on the output, not the compiled
    # forward (tests/engine/compiled/test_compiled_forward.py), whose first compile costs a minute.
    config = ServeConfig(
        model="default", dtype="float32", device="cpu", kv_cache_memory="256MiB",
        max_model_len=2048, max_num_batched_tokens=256, enforce_eager=True,
    )  # fmt: skip
    with live_server(config) as url:
        yield url


@pytest.fixture(scope="module")
def api(server: str) -> openai.OpenAI:
    return client(server)


def valid_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, n=3)],
    ids=["greedy", "sampled", "n3"],
)
def test_json_schema_output_validates(api: openai.OpenAI, sampling: dict[str, Any]) -> None:
    reply = api.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format=RESPONSE_FORMAT, max_tokens=200,
        **sampling,
    )  # fmt: skip
    assert len(reply.choices) == sampling.get("n", 1)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        valid_person(choice.message.content)


def test_json_schema_output_validates_when_streamed(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format=RESPONSE_FORMAT, max_tokens=200,
        temperature=0.7, seed=5, stream=True,
    )  # fmt: skip
    chunks = [chunk for chunk in stream if chunk.choices]
    valid_person("".join(chunk.choices[0].delta.content or "" for chunk in chunks))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_vllm_constraints(api: openai.OpenAI, server: str) -> None:
    ask = "Give a JSON object with the keys city and country for Paris."
    reply = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=100,
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    choice = api.completions.create(
        model=MODEL, prompt="Is the sky green? Answer:", max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    regex = api.completions.create(
        model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0.9, seed=1,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )  # fmt: skip
    assert regex.choices[0].text[:3].isdigit() and regex.choices[0].text[3] == "-"
    assert len(regex.choices[0].text) == 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)  # fmt: skip
def test_constraints_the_engine_cannot_compile_are_a_400(
    server: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": MODEL, "messages": ASK_PERSON, "max_tokens": 5, **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_required_tool_choice_returns_a_valid_call(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_named_tool_choice_is_streamed_as_a_tool_call(api: openai.OpenAI) -> None:
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    stream = api.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[other, WEATHER], max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )  # fmt: skip
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_round_trip(api: openai.OpenAI) -> None:
    first = api.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        max_tokens=100, temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    final = api.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.tool_calls


def test_tool_requests_that_cannot_hold_are_a_400(server: str) -> None:
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "21C"}]}, "messages"),
    ]  # fmt: skip
    for extra, param in cases:
        body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 5, **extra}
        response = httpx.post(f"{server}/v1/chat/completions", json=body)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] is not None and error["param"].startswith(param), (extra, error)


def test_logit_bias_bans_and_forces_on_the_default_model(api: openai.OpenAI, server: str) -> None:
    ask = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=3, temperature=0, logprobs=True)
    first = api.chat.completions.create(**ask).choices[0].logprobs.content[0].token
    [first_id] = httpx.post(f"{server}/tokenize", json={"prompt": first}).json()["tokens"]
    banned = api.chat.completions.create(**ask, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    [forced_id] = httpx.post(f"{server}/tokenize", json={"prompt": " banana"}).json()["tokens"]
    forced = api.chat.completions.create(**ask, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == " banana" * 3
