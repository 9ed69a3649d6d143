"""The chat-shaped request: messages, tools and `ChatCompletionRequest`, which
`/v1/chat/completions` receives and the Responses API's and Anthropic's requests become;
and the tool calls a reply carries back."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    model_validator,
)

from engine.sampling.params import (
    MAX_LOGPROBS,
)
from server.protocol import (
    RequestModel,
    ResponseModel,
    SamplingRequest,
    check_type,
    field_error,
    limits,
)

# Arguments of transformers' `apply_chat_template` that the server sets itself: not
# variables a request may give the template in `chat_template_kwargs` (vLLM refuses
# `chat_template` and `tokenize` there).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
    "tools", "documents", "conversation", "messages", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


class TextPart(RequestModel):
    """A content part; only text ones are supported (this server serves text models)."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return check_type(data, ("text",), "{kind} content parts are not supported: text only")


class FunctionCall(RequestModel):
    """A call an assistant made: `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ChatMessage's invariants on its fields, in its JSON Schema.
_MESSAGE_RULES = {
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "assistant"}}},
            "else": {
                "required": ["content"],
                "properties": {
                    "content": {"not": {"type": "null"}},
                    "tool_calls": {"type": "null"},
                },
            },
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {
                "required": ["tool_call_id"],
                "properties": {"tool_call_id": {"type": "string"}},
            },
        },
    ]
}


class ChatMessage(RequestModel):
    """Invariants: only an assistant message may come without content; `tool_calls` come
    only on assistant messages, and each call's arguments are a JSON object; a tool
    message carries the `tool_call_id` it answers. The schema states all but the
    arguments'."""

    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"required in a {self.role} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise field_error("tool_calls", "only an assistant message makes tool calls")
        for i, call in enumerate(self.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                path = ("tool_calls", i, "function", "arguments")
                raise field_error(path, "must be a JSON object, as text")
        if self.role == "tool" and self.tool_call_id is None:
            raise field_error("tool_call_id", "required in a tool message")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """Invariants: `tool_choice` and `parallel_tool_calls` come only with `tools`; tool
    names are distinct and a named choice names one of them."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = limits(minimum=1)
    max_completion_tokens: int | None = limits(minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = limits(minimum=0, maximum=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template (Qwen3's `enable_thinking: false` turns
    # its thinking off); one the template does not read changes nothing, as in vLLM.
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_kwargs_are_variables(self) -> ChatCompletionRequest:
        check_template_kwargs(self.chat_template_kwargs)
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "function names must be distinct")
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, field) is not None and not self.tools:
                raise field_error(field, "only allowed when tools are given")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error("tool_choice", f"names {choice.function.name!r}, not a tool")
        structured = self.structured_outputs_field
        if self.forces_tool_call and structured is not None:
            raise field_error(structured, "cannot be combined with a tool_choice forcing a call")
        return self

    @property
    def forces_tool_call(self) -> bool:
        """Whether the reply must be tool calls: `required`, or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in sorted(RESERVED_TEMPLATE_KWARGS & (kwargs or {}).keys()):
        raise field_error(("chat_template_kwargs", key), "not supported: the server sets it")


class ResponseFunctionCall(ResponseModel):
    name: str
    arguments: str


class ResponseToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall
