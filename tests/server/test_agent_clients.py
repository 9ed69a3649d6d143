"""The client libraries users call pagedserve with, each against `pagedserve serve` on the
real default model in a process of its own: the official `openai` SDK (chat completions and
the Responses API), LangChain's `ChatOpenAI`, instructor, Pydantic AI, the OpenAI Agents
SDK (its chat completions model and its default, Responses, model), and Anthropic's SDK
on /v1/messages.

Judged on structure, not on the tiny model's wisdom: what comes back parses into the
library's own types and validates. Where a case needs a tool call, the call is forced
(`tool_choice` required or named), which the server enforces with a grammar."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from pathlib import Path

import agents
import anthropic
import httpx
import instructor
import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.server.serve_process import serve_process

pytestmark = pytest.mark.slow

# Budgets: a forced Person is about 60 tokens as a tool call, 30 as plain JSON (every
# string is bounded by its schema, so a greedy loop cannot run on); free text is cut short.
STRUCTURED_TOKENS = 120
TEXT_TOKENS = 32
RESTART_TOKENS = 8  # the restart test starts two servers; its replies need only be there
ASK_PERSON = "Describe a fictional person."
ASK_WEATHER = "What is the weather in Paris?"


class Color(enum.StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Unit(enum.StrEnum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Address(BaseModel):
    city: str = Field(max_length=20)


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    address: Address


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=30)
    unit: Unit  # an Enum in a tool's arguments: a $defs entry


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": GetWeather.__doc__,
        "parameters": GetWeather.model_json_schema(),
    },
}


def weather_report(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


def valid_person(person: object) -> None:
    """A Person whose Enum field and nested model came back as their own types."""
    assert isinstance(person, Person), person
    assert isinstance(person.favourite_color, Color)
    assert isinstance(person.address, Address)


def server_args(store: Path) -> list[str]:
    """`pagedserve serve` on the default model, its stored responses in `store`."""
    return [
        *("--model", "default", "--dtype", "float32", "--device", "cpu"),
        *("--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--log-level", "warning"),
        *("--response-store", str(store)),
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pagedserve serve` on the default model, as users run it, on a free loopback port."""
    folder = tmp_path_factory.mktemp("agent-clients")
    # A first start converts the model and builds the kernels.
    with serve_process(server_args(folder / "responses.sqlite3"), folder / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def model(server: str) -> str:
    """The served model's name, as /v1/models gives it."""
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def api(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def async_api(server: str) -> openai.AsyncOpenAI:
    """A fresh async client per test: it belongs to the event loop that first uses it."""
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


# --- the official openai SDK -------------------------------------------------------------


def test_openai_parse_returns_the_pydantic_model(api: openai.OpenAI, model: str) -> None:
    reply = api.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": ASK_PERSON}], response_format=Person,
        max_tokens=STRUCTURED_TOKENS, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    valid_person(choice.message.parsed)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_openai_stream_reports_usage_last(api: openai.OpenAI, model: str) -> None:
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=TEXT_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    *content, last = chunks
    # every chunk but the last has its one choice and no usage; the last has usage only
    assert all(len(chunk.choices) == 1 and chunk.usage is None for chunk in content)
    assert last.choices == [] and last.usage is not None
    assert "".join(chunk.choices[0].delta.content or "" for chunk in content).strip()
    finishes = [chunk.choices[0].finish_reason for chunk in content]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    usage = last.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= TEXT_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_openai_tool_round_trip(api: openai.OpenAI, server: str, model: str) -> None:
    messages: list = [{"role": "user", "content": ASK_WEATHER}]
    first = api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=STRUCTURED_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
    )  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls"
    call_message = first.choices[0].message
    [call] = call_message.tool_calls
    assert call.function.name == "get_weather"
    arguments = GetWeather.model_validate_json(call.function.arguments)

    messages.append(call_message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": weather_report(arguments.city)}
    )
    # `none` asks for the answer in text: in `auto` the tiny model may call again
    final = api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
        max_tokens=TEXT_TOKENS, temperature=0,
    )  # fmt: skip
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None and choice.message.content.strip()
    # the call and its result went into the prompt (`none` leaves the tools' description out)
    question = httpx.post(f"{server}/tokenize", json={"model": model, "messages": messages[:1]})
    assert final.usage.prompt_tokens > question.json()["count"] + 20


# --- the official anthropic SDK (/v1/messages) -------------------------------------------

ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": GetWeather.__doc__,
    "input_schema": GetWeather.model_json_schema(),
}
GREEDY = {"temperature": 0}  # the SDK has no temperature argument; the API takes one


@pytest.fixture(scope="module")
def claude(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    """Anthropic counts the prompt tokens read from the prefix cache apart."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_anthropic_create_and_count_tokens(claude: anthropic.Anthropic, model: str) -> None:
    ask = [{"role": "user", "content": "Say hello."}]
    reply = claude.messages.create(
        model=model, max_tokens=TEXT_TOKENS, system="You are brief.", messages=ask,
        extra_body=GREEDY,
    )  # fmt: skip
    [block] = reply.content
    assert block.type == "text" and block.text.strip()
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 0 < reply.usage.output_tokens <= TEXT_TOKENS
    counted = claude.messages.count_tokens(model=model, system="You are brief.", messages=ask)
    assert counted.input_tokens == prompt_tokens(reply.usage)


def test_anthropic_stream_tool_round_trip(claude: anthropic.Anthropic, model: str) -> None:
    messages: list = [{"role": "user", "content": ASK_WEATHER}]
    with claude.messages.stream(
        model=model, max_tokens=STRUCTURED_TOKENS, messages=messages, tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:  # fmt: skip
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    arguments = GetWeather.model_validate(use.input)

    result = {
        "type": "tool_result",
        "tool_use_id": use.id,
        "content": weather_report(arguments.city),
    }
    messages += [first.to_param(), {"role": "user", "content": [result]}]
    # `none` asks for the answer in text: in `auto` the tiny model may call again
    with claude.messages.stream(
        model=model, max_tokens=TEXT_TOKENS, messages=messages, tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "none"}, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert text.strip() and [block.type for block in final.content] == ["text"]
    # the call and its result went into the prompt, as count_tokens counts it
    counted = claude.messages.count_tokens(model=model, messages=messages).input_tokens
    assert counted == prompt_tokens(final.usage)
    asked = claude.messages.count_tokens(model=model, messages=messages[:1]).input_tokens
    assert counted > asked + 20


# --- the official openai SDK, Responses API ------------------------------------------------


def test_openai_responses_plain_and_streamed(api: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, input="Say hello.", max_output_tokens=TEXT_TOKENS, temperature=0)
    whole = api.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.output_text.strip()
    assert 0 < whole.usage.output_tokens <= TEXT_TOKENS
    events = list(api.responses.create(**kwargs, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}",
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_openai_responses_function_tool_round_trip(
    api: openai.OpenAI, server: str, model: str
) -> None:
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    first = api.responses.create(
        model=model, input=ASK_WEATHER, tools=[tool], max_output_tokens=STRUCTURED_TOKENS,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
    )  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = GetWeather.model_validate_json(call.arguments)
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": weather_report(arguments.city),
    }
    # the stored call continues: `none` asks for the answer in text
    final = api.responses.create(
        model=model, input=[result], previous_response_id=first.id, tools=[tool],
        tool_choice="none", max_output_tokens=TEXT_TOKENS, temperature=0,
    )  # fmt: skip
    [message] = final.output
    assert message.type == "message" and final.output_text.strip()
    # the stored question and call, and the result, went into the prompt (`none` leaves
    # the tools' description out)
    question = [{"role": "user", "content": ASK_WEATHER}]
    asked = httpx.post(f"{server}/tokenize", json={"model": model, "messages": question})
    assert final.usage.input_tokens > asked.json()["count"] + 20


def test_openai_responses_parse_json_schema(api: openai.OpenAI, model: str) -> None:
    reply = api.responses.parse(
        model=model, input=ASK_PERSON, text_format=Person,
        max_output_tokens=STRUCTURED_TOKENS, temperature=0,
    )  # fmt: skip
    assert reply.status == "completed", reply.output_text
    valid_person(reply.output_parsed)
    assert Person.model_validate_json(reply.output_text) == reply.output_parsed


def test_openai_responses_continue_across_a_server_restart(tmp_path: Path) -> None:
    args, log = server_args(tmp_path / "responses.sqlite3"), tmp_path / "server.log"
    with serve_process(args, log) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = api.models.list().data[0].id
        first = api.responses.create(
            model=model, input="My name is Ada.", max_output_tokens=RESTART_TOKENS, temperature=0
        )
    with serve_process(args, log) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert api.responses.retrieve(first.id).output_text == first.output_text
        second = api.responses.create(
            model=model, input="What is my name?", previous_response_id=first.id,
            max_output_tokens=RESTART_TOKENS, temperature=0,
        )  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


# --- LangChain ---------------------------------------------------------------------------


def chat_openai(server: str, model: str, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server}/v1", api_key="unused", model=model, temperature=0,
        max_tokens=max_tokens, max_retries=0, timeout=120, stream_usage=True,
    )  # fmt: skip


def test_langchain_bind_tools_forced(server: str, model: str) -> None:
    llm = chat_openai(server, model, STRUCTURED_TOKENS)
    reply = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(ASK_WEATHER)
    assert isinstance(reply, AIMessage) and reply.invalid_tool_calls == []
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])


def test_langchain_with_structured_output(server: str, model: str) -> None:
    llm = chat_openai(server, model, STRUCTURED_TOKENS)
    result = llm.with_structured_output(Person, include_raw=True).invoke(ASK_PERSON)
    assert result["parsing_error"] is None
    valid_person(result["parsed"])


def test_langchain_stream(server: str, model: str) -> None:
    llm = chat_openai(server, model, TEXT_TOKENS)
    chunks = list(llm.stream("Say hello."))
    assert len(chunks) > 2 and all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert isinstance(whole.content, str) and whole.content.strip()
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    usage = whole.usage_metadata
    assert usage is not None and 0 < usage["output_tokens"] <= TEXT_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_langchain_batch(server: str, model: str) -> None:
    llm = chat_openai(server, model, TEXT_TOKENS)
    replies = llm.batch(["Say hello.", "Name a colour."])
    assert len(replies) == 2
    for reply in replies:
        assert isinstance(reply, AIMessage) and reply.content.strip()
        assert reply.response_metadata["finish_reason"] in ("stop", "length")
        assert 0 < reply.usage_metadata["output_tokens"] <= TEXT_TOKENS
    assert replies[0].id != replies[1].id


# --- instructor --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor(api: openai.OpenAI, model: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(api, mode=mode)
    person, completion = client.chat.completions.create_with_completion(
        model=model, response_model=Person, messages=[{"role": "user", "content": ASK_PERSON}],
        max_tokens=STRUCTURED_TOKENS, temperature=0, max_retries=0,
    )  # fmt: skip
    valid_person(person)
    message = completion.choices[0].message
    if mode == instructor.Mode.TOOLS:  # a call named after the model, forced by instructor
        assert completion.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls
        assert call.function.name == "Person"
        arguments = call.function.arguments
    else:  # response_format json_schema
        assert completion.choices[0].finish_reason == "stop"
        arguments = message.content
    # (instructor hands back its own subclass of Person: compared as dicts)
    assert Person.model_validate_json(arguments).model_dump() == person.model_dump()


# --- Pydantic AI -------------------------------------------------------------------------


@pytest.mark.parametrize("native", [False, True], ids=["tool_output", "native_output"])
def test_pydantic_ai_agent(server: str, model: str, native: bool) -> None:
    chat_model = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=async_api(server)))
    # The tool output mode forces its `final_result` tool (tool_choice required). Pydantic
    # AI leaves parallel_tool_calls to the server's default (allowed), and the tiny model
    # then writes `final_result` again and again until max_tokens cuts the reply: one call.
    settings = ModelSettings(temperature=0, max_tokens=STRUCTURED_TOKENS, parallel_tool_calls=False)
    agent = Agent(
        chat_model, output_type=NativeOutput(Person) if native else Person,
        model_settings=settings, retries=0,
    )  # fmt: skip
    result = agent.run_sync(ASK_PERSON)
    valid_person(result.output)
    assert result.usage.requests == 1
    [response] = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    if native:  # response_format json_schema: the answer is the text
        [part] = response.parts
        assert isinstance(part, TextPart)
        assert Person.model_validate_json(part.content) == result.output
    else:
        [part] = response.parts
        assert isinstance(part, ToolCallPart) and part.tool_name == "final_result"
        assert Person.model_validate(part.args_as_dict()) == result.output


# --- OpenAI Agents SDK -------------------------------------------------------------------


def test_openai_agents_runner_with_a_function_tool(server: str, model: str) -> None:
    agents.set_tracing_disabled(True)  # no trace export to api.openai.com
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return weather_report(city)

    # The first turn is forced to call get_weather; after a tool has run, the SDK resets
    # tool_choice (reset_tool_choice) and sends none, which is `auto`: the SDK has no way to
    # ask for the answer in text, the model answers on its own (it does, greedily).
    agent = agents.Agent(
        name="weather", instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=model, openai_client=async_api(server)),
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=TEXT_TOKENS * 2, tool_choice="get_weather",
            parallel_tool_calls=False,
        ),
    )  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, ASK_WEATHER, max_turns=3))
    assert len(cities) == 1 and cities[0].strip()
    kinds = [type(item) for item in result.new_items]
    assert kinds == [agents.ToolCallItem, agents.ToolCallOutputItem, agents.MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_openai_agents_default_responses_model_with_a_function_tool(
    server: str, model: str
) -> None:
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return weather_report(city)

    # The SDK's default provider, given this server's client: its model is the Responses one.
    provider = agents.OpenAIProvider(openai_client=async_api(server))
    assert isinstance(provider.get_model(model), agents.OpenAIResponsesModel)
    # The SDK's Responses model fails a reply cut by max_output_tokens (`incomplete`), so
    # the budget holds the whole answer (about 70 tokens, greedily).
    agent = agents.Agent(
        name="weather", instructions="You answer questions about the weather.",
        tools=[get_weather], model=model,
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=STRUCTURED_TOKENS, tool_choice="get_weather",
            parallel_tool_calls=False,
        ),
    )  # fmt: skip
    run_config = agents.RunConfig(model_provider=provider)
    result = asyncio.run(agents.Runner.run(agent, ASK_WEATHER, max_turns=3, run_config=run_config))
    assert len(cities) == 1 and cities[0].strip()
    kinds = [type(item) for item in result.new_items]
    assert kinds == [agents.ToolCallItem, agents.ToolCallOutputItem, agents.MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output.strip()
