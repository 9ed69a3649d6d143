"""/v1/responses against a live server on the tiny Llama, through the official openai SDK:
the same generation as chat completions over the same conversation (one request path),
the stream's events in OpenAI's order, stored responses continued, read and deleted, each
visible to its own API key only, and bad inputs as 4xx in OpenAI's error format that
leave nothing behind. The real default model and the agent clients are in
test_agent_clients.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import client, engine_metrics, live_server, tiny_config

KEY, OTHER_KEY = "sk-alice", "sk-bob"  # the second one comes from a key file
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = 8
ASK = "Hello"
# A tool whose arguments the grammar bounds, so the random model's call ends quickly.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
CALL_TOKENS = 80


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses") / "store.sqlite3"


@pytest.fixture(scope="module")
def config(tiny_model_paths: dict[str, Path], store_path: Path) -> Any:
    key_file = store_path.parent / "keys.txt"
    key_file.write_text(f"# the second user\n\n{OTHER_KEY}\n")
    return tiny_config(
        tiny_model_paths["llama"],
        served_model_name="tiny",
        max_model_len=1024,  # the tools' description takes 450 tokens of the tiny vocabulary
        api_key=[KEY],
        api_key_file=key_file,
        response_store=store_path,
    )


@pytest.fixture(scope="module")
def server(config: Any) -> Iterator[str]:
    with live_server(config) as url:
        yield url


@pytest.fixture(scope="module")
def api(server: str) -> openai.OpenAI:
    return client(server, api_key=KEY)


def chat_text(api: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=TOKENS, temperature=0, **kwargs
    )


def test_plain_response_is_the_chat_completion_of_the_same_conversation(
    api: openai.OpenAI,
) -> None:
    response = api.responses.create(
        model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=TOKENS, temperature=0
    )
    chat = chat_text(
        api, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    )
    assert response.object == "response" and response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == TOKENS
    # cut by max_output_tokens, as the chat completion was by max_tokens
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    assert (response.temperature, response.max_output_tokens, response.store) == (0, TOKENS, True)


def test_stream_sends_openais_events_in_order(api: openai.OpenAI) -> None:
    whole = api.responses.create(model="tiny", input=ASK, max_output_tokens=TOKENS, temperature=0)
    events = list(
        api.responses.create(
            model="tiny", input=ASK, max_output_tokens=TOKENS, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[kinds.index("response.output_text.done")]
    assert done.text == text and done.item_id == events[2].item.id
    last = events[-1].response
    assert last.output_text == text and last.usage.output_tokens == TOKENS
    # a streamed response is stored too
    assert api.responses.retrieve(last.id).output_text == text


def test_previous_response_id_continues_the_stored_conversation(api: openai.OpenAI) -> None:
    first = api.responses.create(model="tiny", input=ASK, max_output_tokens=TOKENS, temperature=0)
    second = api.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id,
        max_output_tokens=TOKENS, temperature=0,
    )  # fmt: skip
    chat = chat_text(
        api,
        [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # the stored conversation's prefix is served from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens > 0
    stored = api.responses.retrieve(second.id)
    assert stored.model_dump() == second.model_dump()


def test_store_false_keeps_nothing_and_delete_forgets(api: openai.OpenAI) -> None:
    unstored = api.responses.create(
        model="tiny", input=ASK, max_output_tokens=2, temperature=0, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        api.responses.create(model="tiny", input=ASK, previous_response_id=unstored.id)
    stored = api.responses.create(model="tiny", input=ASK, max_output_tokens=2, temperature=0)
    api.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(stored.id)


def test_a_stored_response_is_its_keys_alone(server: str, api: openai.OpenAI) -> None:
    mine = api.responses.create(model="tiny", input=ASK, max_output_tokens=2, temperature=0)
    other = client(server, api_key=OTHER_KEY)
    for attempt in (
        lambda: other.responses.retrieve(mine.id),
        lambda: other.responses.delete(mine.id),
        lambda: other.responses.create(model="tiny", input=ASK, previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        # the same answer as for an id that never existed: nothing says it does
        assert mine.id in str(refused.value) and "another" not in str(refused.value)
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="sk-mallory").responses.retrieve(mine.id)
    assert api.responses.retrieve(mine.id).id == mine.id  # undeleted
    # the other key is a key: it creates and reads its own
    theirs = other.responses.create(model="tiny", input=ASK, max_output_tokens=2)
    assert other.responses.retrieve(theirs.id).id == theirs.id


def test_forced_function_call_and_its_output_round_trip(api: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = api.responses.create(
        model="tiny", input=ask, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=CALL_TOKENS, temperature=0,
    )  # fmt: skip
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id.startswith("call_") and call.status == "completed"
    # the call answered by nothing, after the stored response or in the input: a 400
    unanswered = [*ask, call.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
    for kwargs in ({"input": "And Rome?", "previous_response_id": first.id}, {"input": unanswered}):
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(model="tiny", max_output_tokens=TOKENS, **kwargs)
        assert f"function call {call.call_id!r}" in refused.value.body["message"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    # stateless: the call and its output sent back; stateful: the output after the call
    sent_back = api.responses.create(
        model="tiny", input=[*ask, call.model_dump(exclude_none=True), result],
        tools=[WEATHER], tool_choice="none", max_output_tokens=TOKENS, temperature=0,
    )  # fmt: skip
    continued = api.responses.create(
        model="tiny", input=[result], previous_response_id=first.id,
        tools=[WEATHER], tool_choice="none", max_output_tokens=TOKENS, temperature=0,
    )  # fmt: skip
    chat = api.chat.completions.create(
        model="tiny",
        messages=[
            *ask,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none", max_tokens=TOKENS, temperature=0,
    )  # fmt: skip
    for response in (sent_back, continued):
        assert [item.type for item in response.output] == ["message"]
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_function_call_events(api: openai.OpenAI) -> None:
    events = list(
        api.responses.create(
            model="tiny", input="Weather in Rome?", tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=CALL_TOKENS, temperature=0, stream=True,
        )
    )  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert delta.delta == done.arguments == item_done.item.arguments
    assert done.name == "get_weather" and done.item_id == added.item.id
    [call] = completed.response.output
    assert call.arguments == done.arguments and call.call_id == added.item.call_id


def test_text_format_json_schema_holds_the_reply(api: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    response = api.responses.create(
        model="tiny", input="Name a colour.", max_output_tokens=CALL_TOKENS, temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema}},
    )  # fmt: skip
    assert response.status == "completed"
    assert json.loads(response.output_text)["colour"] in ("red", "green")
    assert response.text.format.type == "json_schema"


def test_reasoning_items_sent_back_are_accepted_and_not_rendered(api: openai.OpenAI) -> None:
    reasoning = {
        "type": "reasoning", "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "The user greets."}],
    }  # fmt: skip
    reply = {"role": "assistant", "content": "Hi."}
    then = {"role": "user", "content": "Again"}
    kwargs = dict(model="tiny", max_output_tokens=TOKENS, temperature=0)
    plain = api.responses.create(input=[{"role": "user", "content": ASK}, reply, then], **kwargs)
    reasoned = api.responses.create(
        input=[{"role": "user", "content": ASK}, reasoning, reply, then], **kwargs
    )
    assert reasoned.output_text == plain.output_text
    assert reasoned.usage.input_tokens == plain.usage.input_tokens


# case -> (body changes, expected status, expected `param`)
BAD_REQUESTS: dict[str, tuple[dict[str, Any], int, str | None]] = {
    "input number": ({"input": 5}, 400, "input"),
    "max_output_tokens string": ({"max_output_tokens": "5"}, 400, "max_output_tokens"),
    "zero max_output_tokens": ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    "temperature word": ({"temperature": "hot"}, 400, "temperature"),
    "top_p above one": ({"top_p": 1.5}, 400, "top_p"),
    "unknown item type": ({"input": [{"type": "web_search_call"}]}, 400, "input[0].type"),
    "item without type": ({"input": [{"content": "hi"}]}, 400, "input[0]"),
    "image part": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input[0].content[0].type",
    ),
    "message role number": ({"input": [{"role": 1, "content": "hi"}]}, 400, "input[0].role"),
    "output without its call": (
        {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]},
        400,
        "input[0].call_id",
    ),
    "call without its output": (
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            ]
        },
        400,
        "input[1]",
    ),
    "call arguments not an object": (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
        400,
        "input[0].arguments",
    ),
    "encrypted reasoning": (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
        400,
        "input[0].encrypted_content",
    ),
    "empty conversation": ({"input": []}, 400, "input"),
    "unknown previous_response_id": (
        {"previous_response_id": "resp_0"},
        404,
        "previous_response_id",
    ),
    "hosted tool": ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    "tool_choice names no tool": (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
        400,
        "tool_choice",
    ),
    "tool_choice without tools": ({"tool_choice": "required"}, 400, "tool_choice"),
    "json_schema without schema": (
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        400,
        "text.format.schema",
    ),
    "bad schema": (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
        400,
        "text.format",
    ),
    "reasoning settings": ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
    "background": ({"background": True}, 400, "background"),
    "truncation auto": ({"truncation": "auto"}, 400, "truncation"),
    "include": ({"include": ["message.output_text.logprobs"]}, 400, "include[0]"),
    "unknown field": ({"temprature": 0}, 400, "temprature"),
    "unknown model": ({"model": "gpt-5"}, 404, "model"),
    "too long": ({"input": "fox " * 2000}, 400, None),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_are_openai_errors_and_leave_nothing(server: str, case: str) -> None:
    changes, status, param = BAD_REQUESTS[case]
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 2, **changes}
    for stream in (False, True):
        response = httpx.post(
            f"{server}/v1/responses", json={**body, "stream": stream}, headers=AUTH
        )
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, error
    assert idle(server)


def test_a_stream_left_early_is_aborted(server: str) -> None:
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server}/v1/responses", json=body, headers=AUTH) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: response.created"
    assert idle(server)


def test_stored_responses_survive_a_restart(config: Any, tmp_path: Path) -> None:
    moved = config.model_copy(update={"response_store": tmp_path / "store.sqlite3"})
    with live_server(moved) as url:
        first = client(url, api_key=KEY).responses.create(
            model="tiny", input=ASK, max_output_tokens=TOKENS, temperature=0
        )
    with live_server(moved) as url:
        api = client(url, api_key=KEY)
        assert api.responses.retrieve(first.id).model_dump() == first.model_dump()
        second = api.responses.create(
            model="tiny", input="And then?", previous_response_id=first.id,
            max_output_tokens=TOKENS, temperature=0,
        )  # fmt: skip
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        with pytest.raises(openai.NotFoundError):
            client(url, api_key=OTHER_KEY).responses.retrieve(first.id)


def idle(url: str, timeout: float = 10) -> bool:
    """Whether the engine soon runs nothing and holds no KV block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = engine_metrics(url)
        if (
            metrics["pagedserve_kv_cache_usage_ratio"] == 0
            and metrics["vllm:num_requests_running"] == 0
        ):
            return True
        time.sleep(0.05)
    return False
