"""Tool-call formats without a model: parsing, streaming splits, the grammars that force a
call (compiled by the grammar engine, and accepting exactly what `parse` reads back), and
the conversation a template that ignores tools is given."""

from __future__ import annotations

import json

import llguidance
import pytest

from server.chat_tools import ChatTools, ToolSyntax, conversation
from server.protocol import ChatCompletionRequest, ChatMessage
from server.tools import (
    Function,
    HermesFormat,
    Llama3JsonFormat,
    ParsedToolCall,
    ToolCallStream,
    choose_format,
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
    tools = ChatTools.of(body)
    assert tools is not None and tools.forced is None
    plain = ToolSyntax(HERMES, template_takes_tools=False)
    rendered = conversation(body.messages, plain, tools)
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and '"Oslo"' in rendered[2]["content"]
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n-3C\n</tool_response>"}
    native = conversation(body.messages, ToolSyntax(HERMES, template_takes_tools=True), tools)
    assert len(native) == 3 and native[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"
    }
    assert native[2]["tool_call_id"] == "call_1"
    assert tools.for_template(plain) is None
    assert tools.for_template(ToolSyntax(HERMES, True))[0]["function"]["name"] == "get_weather"


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


def walks(grammar: str, text: str) -> bool:
    """Whether `text`, byte by byte, is a complete sentence of `grammar`."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    for byte in text.encode():
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()


def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer of one token per byte, to walk a grammar byte by byte."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


class _Bytes:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)
