"""Tool-call formats without a model: parsing, streaming splits, the grammars that force a
call (compiled by the grammar engine, and accepting exactly what `parse` reads back), and
the conversation a template that ignores tools is given. Then Pydantic's tool schemas
(`$defs` and `$ref`s for enums and nested models, as instructor and pydantic-ai send them)
through a live server on the tiny model, in every tool mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest

from server.chat_protocol import ChatCompletionRequest, ChatMessage
from server.conversation import Function, ToolRequest
from server.tools.call_formats import (
    HermesFormat,
    Llama3JsonFormat,
    ParsedToolCall,
    ToolCallStream,
    choose_format,
)
from server.tools.chat_tools import ToolSyntax
from tests.server.conftest import client, live_server, tiny_config
from tests.support.tool_schemas import (
    A_MOVE,
    A_PAINT,
    A_REFILL,
    ASK_PAINT,
    MOVE,
    PAINT,
    REFILL,
    TOOLS,
    Color,
    Paint,
    calls_and_finish_reason,
    valid_call,
    walks,
)

WEATHER = Function(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
ADD = Function("add", None, {})
HERMES, LLAMA = HermesFormat(), Llama3JsonFormat()


def test_hermes_reads_calls_after_text() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert calls == [
        ParsedToolCall("get_weather", '{"city": "Paris"}'),
        ParsedToolCall("add", '{"a": 1}'),
    ]


@pytest.mark.parametrize(
    "text",
    ["plain text", "<tool_call>\n{broken", '<tool_call>{"arguments": {}}</tool_call>', ""],
)
def test_text_without_a_well_formed_call_is_all_content(text: str) -> None:
    assert HERMES.parse(text) == (text, [])
    assert LLAMA.parse(text) == (text, [])


def test_llama3_reads_one_or_several_calls() -> None:
    content, calls = LLAMA.parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", '
        '"parameters": {"city": "Rome"}}'
    )
    assert content is None
    assert [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"}
    assert LLAMA.parse("The set {1, 2} has two elements.")[1] == []


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammars_accept_what_parse_reads(tool_format, parallel) -> None:
    grammar = llguidance.grammar_from("grammar", tool_format.call_grammar([WEATHER, ADD], parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    calls = [tool_format.render_call("get_weather", {"city": "Oslo"})]
    if parallel:
        calls.append(tool_format.render_call("add", {}))
    separator = "\n" if tool_format is HERMES else "; "
    text = separator.join(calls)
    assert walks(grammar, text), text
    _, parsed = tool_format.parse(text)
    assert [c.name for c in parsed] == (["get_weather", "add"] if parallel else ["get_weather"])


def test_a_call_of_an_unknown_function_or_bad_arguments_breaks_the_grammar() -> None:
    grammar = llguidance.grammar_from("grammar", HERMES.call_grammar([WEATHER], False))
    assert walks(grammar, HERMES.render_call("get_weather", {"city": "Oslo"}))
    assert not walks(grammar, HERMES.render_call("delete_everything", {}))
    assert not walks(grammar, HERMES.render_call("get_weather", {"town": "Oslo"}))


def test_a_forced_call_is_written_as_json_dumps_writes_it() -> None:
    """No optional whitespace, inside the arguments or around them."""
    grammar = llguidance.grammar_from("grammar", HERMES.call_grammar([WEATHER], False))
    call = HERMES.render_call("get_weather", {"city": "Oslo"})
    assert walks(grammar, call)
    assert not walks(grammar, call.replace('": ', '":'))
    assert not walks(grammar, call.replace('{"city"', '{ "city"'))
    assert not walks(grammar, call.replace('{"name"', '{\n"name"'))


@pytest.mark.parametrize(
    ("deltas", "streamed", "rest", "names"),
    [
        (["Hello ", "there <", "tool_", 'call>\n{"name": "add", "arguments": {}}',
          "\n</tool_call>"], "Hello there ", "", ["add"]),
        (["a <b", "> c <t"], "a <b> c ", "<t", []),
        (["no calls at all"], "no calls at all", "", []),
    ],
)  # fmt: skip
def test_hermes_stream_holds_back_only_what_may_be_a_call(deltas, streamed, rest, names) -> None:
    stream = ToolCallStream(HERMES, all_calls=False)
    assert "".join(stream.feed(d) for d in deltas) == streamed
    tail, calls = stream.finish()
    assert tail == rest and [c.name for c in calls] == names


def test_llama3_stream_holds_a_reply_that_opens_as_json() -> None:
    stream = ToolCallStream(LLAMA, all_calls=False)
    assert stream.feed("  ") == "" and stream.feed('{"name": "add", ') == ""
    assert stream.feed('"parameters": {}}') == ""
    assert stream.finish() == ("", [ParsedToolCall("add", "{}")])
    prose = ToolCallStream(LLAMA, all_calls=False)
    assert prose.feed(" Sure") == " Sure" and prose.feed(", {x}") == ", {x}"


def test_a_forced_call_holds_everything() -> None:
    stream = ToolCallStream(HERMES, all_calls=True)
    assert stream.feed("whatever") == ""
    assert stream.finish() == ("whatever", [])


def test_auto_picks_the_format_the_template_writes() -> None:
    assert choose_format("auto", "{{ '<tool_call>' }} tools").name == "hermes"
    assert choose_format("auto", "{{- '<|python_tag|>' }} {{ tools }}").name == "llama3_json"
    assert choose_format("auto", None).name == "hermes"
    assert choose_format("llama3_json", "<tool_call>").name == "llama3_json"


def test_a_template_without_tools_gets_them_in_text() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "-3C"},
            ],
        }
    )
    request = ToolRequest.of(body)
    assert request is not None and request.forced is None
    plain = ToolSyntax(HERMES, template_takes_tools=False).offer(request)
    rendered = plain.conversation(body.messages)
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and '"Oslo"' in rendered[2]["content"]
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n-3C\n</tool_response>"}
    native_tools = ToolSyntax(HERMES, template_takes_tools=True).offer(request)
    native = native_tools.conversation(body.messages)
    assert len(native) == 3 and native[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"
    }
    assert native[2]["tool_call_id"] == "call_1"
    assert plain.template_tools() is None
    assert native_tools.template_tools()[0]["function"]["name"] == "get_weather"


def test_tool_messages_are_checked() -> None:
    with pytest.raises(ValueError, match="required in a tool message"):
        ChatMessage.model_validate({"role": "tool", "content": "x"})
    with pytest.raises(ValueError, match="JSON object"):
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                ],
            }
        )


def test_the_pydantic_tools_share_a_defs_name_with_different_content() -> None:
    paint, refill = PAINT.parameters["$defs"]["Color"], REFILL.parameters["$defs"]["Color"]
    assert paint["enum"] == ["red", "green"] and refill["enum"] == ["cyan", "magenta"]
    assert PAINT.parameters["properties"]["color"] == {"$ref": "#/$defs/Color"}
    assert "oneOf" in PAINT.parameters["properties"]["shape"]


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammars_resolve_each_tools_own_refs(tool_format, parallel) -> None:
    tools = [PAINT, REFILL, MOVE]
    grammar = llguidance.grammar_from("grammar", tool_format.call_grammar(tools, parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    calls = [("paint", A_PAINT), ("refill", A_REFILL), ("move", A_MOVE)]
    separator = "\n" if tool_format is HERMES else "; "
    texts = [tool_format.render_call(*c) for c in calls]
    if parallel:
        texts = [separator.join(texts)]
    parsed = []
    for text in texts:
        assert walks(grammar, text), text
        parsed += tool_format.parse(text)[1]
    assert [c.name for c in parsed] == ["paint", "refill", "move"]
    schemas = {f.name: f.parameters for f in tools}
    for call in parsed:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert Paint.model_validate_json(parsed[0].arguments).color is Color.GREEN


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("paint", A_PAINT | {"color": "cyan"}),  # the other tool's Color
        ("refill", A_REFILL | {"color": "red"}),
        ("paint", A_PAINT | {"shape": {"kind": "circle", "corner": {"x": 1, "y": 1}}}),
        ("paint", A_PAINT | {"path": [{"x": 1, "y": 1, "z": 1}]}),  # additionalProperties
        ("paint", {k: v for k, v in A_PAINT.items() if k != "anchor"}),  # required
        ("move", A_MOVE | {"then": [4]}),  # through #/properties/first to #/definitions
        ("move", A_MOVE | {"first": "2"}),
    ],
)  # fmt: skip
def test_forced_call_grammars_refuse_what_the_tools_schema_refuses(
    tool_format, name: str, arguments: dict[str, Any]
) -> None:
    tools = [PAINT, REFILL, MOVE]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(arguments, {f.name: f.parameters for f in tools}[name])
    grammar = llguidance.grammar_from("grammar", tool_format.call_grammar(tools, False))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert not walks(grammar, tool_format.render_call(name, arguments))


@pytest.fixture(scope="module")
def api(tiny_model_paths: dict[str, Path]) -> Iterator[openai.OpenAI]:
    """The tiny Llama (its template ignores tools: they are described in a system message,
    which these schemas make long)."""
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", max_model_len=4096,
        kv_cache_memory="128MiB",
    )  # fmt: skip
    with live_server(config) as url:
        yield client(url)


@pytest.mark.parametrize(
    ("tool_choice", "stream"),
    [("required", False), ("paint", True), ("refill", False)],
)
def test_pydantic_schemas_in_forced_calls(
    api: openai.OpenAI, tool_choice: str, stream: bool
) -> None:
    choice: Any = tool_choice
    if tool_choice != "required":
        choice = {"type": "function", "function": {"name": tool_choice}}
    reply = api.chat.completions.create(
        model="tiny", messages=ASK_PAINT, tools=TOOLS, tool_choice=choice, max_tokens=300,
        temperature=0, parallel_tool_calls=False, stream=stream,
    )  # fmt: skip
    calls, finish_reason = calls_and_finish_reason(reply, stream)
    assert finish_reason == "tool_calls"
    [call] = calls
    assert tool_choice == "required" or call.function.name == tool_choice
    valid_call(call.function.name, call.function.arguments)


def test_pydantic_schemas_in_auto_mode(api: openai.OpenAI) -> None:
    """The model may answer in text or call; a call it makes validates. Earlier calls with
    nested arguments, and their results, go back in."""
    messages = [
        *ASK_PAINT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "paint", "arguments": json.dumps(A_PAINT)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "painted"},
    ]  # fmt: skip
    for conversation_so_far in (ASK_PAINT, messages):
        reply = api.chat.completions.create(
            model="tiny", messages=conversation_so_far, tools=TOOLS, tool_choice="auto",
            max_tokens=20, temperature=0,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content or choice.message.tool_calls
        for call in choice.message.tool_calls or []:
            valid_call(call.function.name, call.function.arguments)
