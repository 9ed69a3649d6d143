"""The tools component's side of `server.conversation`: how the served model's conversation
carries tools and calls, the grammar of the calls (forcing one, or in `auto` holding a
begun call to its schema), and the calls read back out of a reply's text.

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
from server.chat_protocol import ChatMessage, ResponseFunctionCall, ResponseToolCall
from server.conversation import ToolRequest, plain_message
from server.tools.call_formats import ParsedToolCall, ToolCallFormat, ToolCallStream, choose_format
from server.tools.call_formats import template_takes_tools as takes_tools

if TYPE_CHECKING:
    from engine.request.intake import SpecialTokens


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """How this server's model reads and writes tool calls (a `ToolCalling`). `tokens`
    are the format's markers that the tokenizer holds as tokens of their own that decode
    as text, with their ids; `special_ids` every id the grammar engine counts as a special
    token."""

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

    def offer(self, request: ToolRequest) -> ChatTools:
        return ChatTools(request, self)

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as the chat template reads them (see the module docstring)."""
        return [self._message(m) for m in messages]

    def _message(self, message: ChatMessage) -> dict[str, Any]:
        result = plain_message(message)
        text = result["content"]
        if message.tool_calls:
            calls = [
                (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
            ]
            if not self.template_takes_tools:
                written = "\n".join(self.format.render_call(name, args) for name, args in calls)
                result["content"] = f"{text}\n{written}" if text else written
            else:
                result["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                    for c, (n, a) in zip(message.tool_calls, calls, strict=True)
                ]
        if message.role == "tool":
            if not self.template_takes_tools:
                result["content"] = f"<tool_response>\n{text}\n</tool_response>"
            else:
                result["tool_call_id"] = message.tool_call_id
        return result


@dataclass(frozen=True, slots=True)
class ChatTools:
    """One request's tools in this server's call format (an `OfferedTools`)."""

    request: ToolRequest
    syntax: ToolSyntax

    @property
    def forced(self) -> bool:
        return self.request.forced is not None

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages, with the tools described in a system message where the template
        ignores its `tools` argument."""
        rendered = self.syntax.conversation(messages)
        if self.syntax.template_takes_tools:
            return rendered
        instructions = self.syntax.format.instructions(self.request.functions)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{instructions}"}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
        return rendered

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.syntax.template_takes_tools:
            return None
        return [function.as_openai() for function in self.request.functions]

    def structured_outputs(self) -> StructuredOutputs:
        """Calls only when one is forced; else (`auto`) any text, but once the model
        begins a call (the format's opener), the rest of the reply is calls whose names
        are the tools' and whose arguments match their schemas."""
        request, syntax = self.request, self.syntax
        if request.forced is None:
            return StructuredOutputs(
                grammar=syntax.format.auto_grammar(
                    request.functions, request.parallel, syntax.tokens, syntax.special_ids
                )
            )
        forced = syntax.format.call_grammar(request.forced, request.parallel)
        return StructuredOutputs(grammar=forced)

    def response_calls(self, text: str) -> tuple[str | None, list[ResponseToolCall]]:
        content, calls = self.syntax.format.parse(text)
        if not calls:
            return text, []
        return content, self.as_response(calls)

    def stream(self) -> ResponseCallStream:
        return ResponseCallStream(ToolCallStream(self.syntax.format, self.forced), self)

    def as_response(self, calls: list[ParsedToolCall]) -> list[ResponseToolCall]:
        """The calls in OpenAI's shape, each with a fresh id; one only unless `parallel`."""
        kept = calls if self.request.parallel else calls[:1]
        return [
            ResponseToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=ResponseFunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in kept
        ]


@dataclass(slots=True)
class ResponseCallStream:
    """A `ToolCallStream` whose calls come out in OpenAI's shape (a `CallStream`)."""

    text: ToolCallStream
    tools: ChatTools

    def feed(self, delta: str) -> str:
        return self.text.feed(delta)

    def finish(self) -> tuple[str, list[ResponseToolCall]]:
        rest, parsed = self.text.finish()
        return rest, self.tools.as_response(parsed) if parsed else []
