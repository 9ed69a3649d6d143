"""A chat request's tools: the conversation as the template reads it, the grammar of the
calls (forcing one, or in `auto` holding a begun call to its schema), and the calls read
back out of each choice's text.

The chat template renders the tools when it takes a `tools` list (Qwen's, Llama 3's and
most tool-trained models'); for a template that ignores them, the tools are described in
a system message and earlier calls and results are written into the messages' text in
the server's tool-call format, so every model sees the same conversation it would have
produced.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.sampling.params import StructuredOutputs
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
)
from server.tools.call_formats import Function, ParsedToolCall, ToolCallFormat, choose_format
from server.tools.call_formats import template_takes_tools as takes_tools

if TYPE_CHECKING:
    from engine.request.intake import SpecialTokens


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """How this server's model reads and writes tool calls. `tokens` are the format's
    markers that the tokenizer holds as tokens of their own that decode as text, with
    their ids; `special_ids` every id the grammar engine counts as a special token."""

    format: ToolCallFormat
    template_takes_tools: bool
    tokens: Mapping[str, int] = field(default_factory=dict)
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def of(
        cls, setting: str, chat_template: str | None, special: SpecialTokens | None = None
    ) -> ToolSyntax:
        """`special`: the model's special tokens (`AsyncLLM.special_tokens`), if known."""
        tool_format = choose_format(setting, chat_template)
        if special is None:
            return cls(tool_format, takes_tools(chat_template))
        tokens = {m: special.text[m] for m in tool_format.markers if m in special.text}
        return cls(tool_format, takes_tools(chat_template), tokens, special.ids)


@dataclass(frozen=True, slots=True)
class ChatTools:
    """The tools one request offers. `forced` are the functions the reply must call one
    of (all of them for `required`, one for a named choice), None when the model may
    answer in text; `parallel` allows several calls in one reply (never for a named
    choice, which asks for one call of that function)."""

    functions: list[Function]
    forced: list[Function] | None
    parallel: bool

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ChatTools | None:
        """None when the request offers no tools, or forbids calls (`tool_choice: none`)."""
        if not body.tools or body.tool_choice == "none":
            return None
        functions = [
            Function(t.function.name, t.function.description, t.function.parameters or {})
            for t in body.tools
        ]
        forced: list[Function] | None = None
        parallel = body.parallel_tool_calls is not False
        if body.tool_choice == "required":
            forced = functions
        elif isinstance(body.tool_choice, NamedToolChoice):
            forced = [f for f in functions if f.name == body.tool_choice.function.name]
            parallel = False
        return cls(functions, forced, parallel)

    def structured_outputs(self, syntax: ToolSyntax) -> StructuredOutputs:
        """The grammar of the reply: calls only when one is forced; else (`auto`) any text,
        but once the model begins a call (the format's opener), the rest of the reply is
        calls whose names are the tools' and whose arguments match their schemas."""
        if self.forced is None:
            return StructuredOutputs(
                grammar=syntax.format.auto_grammar(
                    self.functions, self.parallel, syntax.tokens, syntax.special_ids
                )
            )
        return StructuredOutputs(grammar=syntax.format.call_grammar(self.forced, self.parallel))

    def for_template(self, syntax: ToolSyntax) -> list[dict[str, Any]] | None:
        """The `tools` argument of the chat template, if it takes one."""
        if not syntax.template_takes_tools:
            return None
        return [function.as_openai() for function in self.functions]

    def response_calls(
        self, text: str, syntax: ToolSyntax
    ) -> tuple[str | None, list[ResponseToolCall]]:
        """A choice's content and tool calls, read from its whole text."""
        content, calls = syntax.format.parse(text)
        if not calls:
            return text, []
        return content, self.as_response(calls)

    def as_response(self, calls: list[ParsedToolCall]) -> list[ResponseToolCall]:
        """The calls in OpenAI's shape, each with a fresh id; one only unless `parallel`."""
        kept = calls if self.parallel else calls[:1]
        return [
            ResponseToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=ResponseFunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in kept
        ]


def conversation(
    messages: list[ChatMessage],
    syntax: ToolSyntax | None = None,
    tools: ChatTools | None = None,
) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (see the module docstring); without
    `syntax`, earlier tool calls are handed to the template as they are."""
    rendered = [_message(m, syntax) for m in messages]
    if tools is not None and syntax is not None and not syntax.template_takes_tools:
        instructions = syntax.format.instructions(tools.functions)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{instructions}"}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def template_inputs(
    body: ChatCompletionRequest, syntax: ToolSyntax, tools: ChatTools | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None]:
    """The messages, the `tools` argument and the other variables (`chat_template_kwargs`)
    the chat template renders for `body`: what `/v1/chat/completions` tokenizes, so
    anything that predicts its prompt (the scale-out router) renders the same tokens."""
    template_tools = tools.for_template(syntax) if tools is not None else None
    return conversation(body.messages, syntax, tools), template_tools, body.chat_template_kwargs


def _message(message: ChatMessage, syntax: ToolSyntax | None) -> dict[str, Any]:
    text = message.text()
    result: dict[str, Any] = {"role": message.role, "content": text}
    if message.name:
        result["name"] = message.name
    in_text = syntax is not None and not syntax.template_takes_tools
    if message.tool_calls:
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        if in_text:
            assert syntax is not None
            written = "\n".join(syntax.format.render_call(name, args) for name, args in calls)
            result["content"] = f"{text}\n{written}" if text else written
        else:
            result["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                for c, (n, a) in zip(message.tool_calls, calls, strict=True)
            ]
    if message.role == "tool":
        if in_text:
            result["content"] = f"<tool_response>\n{text}\n</tool_response>"
        else:
            result["tool_call_id"] = message.tool_call_id
    return result
