"""The wire format of OpenAI's Responses API (`/v1/responses`): the request body
(validated, strict and closed like every request model of `server.protocol`) and the
response object (constructed).

Supported: `input` as text or as items (messages, function calls and their outputs,
reasoning), `reasoning` (checked against the served model by `server.responses.input`),
`instructions`, function `tools` with `tool_choice` and
`parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`max_output_tokens`, `temperature`, `top_p`, `stream`, `store`, `previous_response_id`,
`metadata`. Fields OpenAI defines that this server cannot honour are refused by name
(`UNSUPPORTED_RESPONSES_FIELDS`), as are item, content part and tool types other than
the ones above.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, model_validator

from server.chat_protocol import FunctionDefinition
from server.config import KeepAlive
from server.protocol import RequestBody, RequestModel, ResponseModel, check_type, field_error

# Responses fields that would change the output and that this server does not implement:
# a 400 "not supported" with the reason, unless sent as null.
UNSUPPORTED_RESPONSES_FIELDS: dict[str, str] = {
    "background": "background responses are not implemented",
    "conversation": "conversation objects are not implemented; use previous_response_id",
    "prompt": "stored prompt templates are not implemented",
    "max_tool_calls": "a cap on built-in tool calls does not apply: function tools only",
    "top_logprobs": "logprobs are not implemented on /v1/responses",
    "context_management": "context management (compaction) is not implemented",
    "moderation": "moderation is not implemented",
}

# The `type`s of the input items this server takes.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ContentPart(RequestModel):
    """A text part of a message: `input_text` (what users and instructions write) or
    `output_text` (an assistant's, sent back; its annotations and logprobs cannot change
    the output and are not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        message = "{kind} content parts are not supported: text only"
        return check_type(data, ("input_text", "output_text"), message)


def _joined(content: str | list[ContentPart]) -> str:
    """Content as one string; parts are joined by newlines, as chat joins them."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(RequestModel):
    """A call the model made. Invariant: `arguments` is a JSON object, as text."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="after")
    def _arguments_are_an_object(self) -> FunctionCallItem:
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise field_error("arguments", "must be a JSON object, as text")
        return self


class FunctionCallOutputItem(RequestModel):
    """A call's result, which the client computed; it answers the call of `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return _joined(self.output)


class SummaryText(RequestModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(RequestModel):
    """Reasoning a client sends back with the rest of a turn. Its text is kept with the
    conversation but not rendered into the prompt (see docs/responses.md); encrypted
    reasoning, which only its issuer can read, is refused."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_encrypted_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("encrypted_content") is not None:
            reason = "encrypted reasoning can only be read by the provider that issued it"
            raise field_error("encrypted_content", f"not supported: {reason}")
        return data


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


class FunctionTool(FunctionDefinition):
    """A function the model may call; the Responses API writes it flat."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        message = "{kind} tools are not supported: function tools only"
        return check_type(data, ("function",), message)


class FunctionChoice(RequestModel):
    """`tool_choice` naming the one function the reply must call."""

    type: Literal["function"]
    name: str

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        reason = "a tool_choice names a function tool (or is none, auto or required)"
        return check_type(data, ("function",), "{kind} is not supported: " + reason)


class TextFormat(RequestModel):
    """`text.format`; `name`, `schema`, `description` and `strict` belong to json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise field_error("schema", "required when type is json_schema")
        if self.type != "json_schema" and self.schema_ is not None:
            raise field_error("schema", "only allowed when type is json_schema")
        return self


class ReasoningConfig(RequestModel):
    """`reasoning`. Invariant: it asks for no summary (none is written); whether the served
    model can honour the rest is checked at request time (`input.py`)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn"] | None = None

    @model_validator(mode="after")
    def _no_summary(self) -> ReasoningConfig:
        for name in ("summary", "generate_summary"):
            if getattr(self, name) is not None:
                raise field_error(name, "not supported: no reasoning summaries are written")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """POST /v1/responses. Invariants: `tool_choice` and `parallel_tool_calls` come only
    with `tools`; tool names are distinct and a named choice names one of them; a reply
    forced to call a tool has no `text.format` but text; `include` asks for nothing."""

    model: str
    # Ollama's: how long the model stays loaded after this request (server/model_pool.py).
    keep_alive: KeepAlive | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extension, as on chat: a lower value is served first under the priority policy.
    priority: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, reason in UNSUPPORTED_RESPONSES_FIELDS.items():
            if data.get(name) is not None:
                raise field_error(name, f"not supported: {reason}")
        if data.get("truncation") == "auto":
            reason = "a conversation too long for the context is a 400, never truncated"
            raise field_error("truncation", f"'auto' is not supported: {reason}")
        items = data.get("input")
        if isinstance(items, list):
            data = {**data, "input": [_typed_item(i, item) for i, item in enumerate(items)]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        if self.include:
            raise field_error(("include", 0), "not supported: nothing can be included")
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "function names must be distinct")
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, field) is not None and not self.tools:
                raise field_error(field, "only allowed when tools are given")
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice) and choice.name not in names:
            raise field_error("tool_choice", f"names {choice.name!r}, not a tool")
        forced = self.tool_choice == "required" or isinstance(choice, FunctionChoice)
        if forced and self.text_format.type != "text":
            raise field_error(("text", "format"), "cannot be combined with a forced tool call")
        return self

    @property
    def text_format(self) -> TextFormat:
        """The format asked for; plain text when none is."""
        given = self.text.format if self.text is not None else None
        return given if given is not None else TextFormat(type="text")

    def input_items(self) -> list[InputItem]:
        """`input` as items: text is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def _typed_item(index: int, item: Any) -> Any:
    """An input item with its `type` (a message may leave it out); a 400 naming it for an
    item type this server does not take."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message" if "role" in item else None)
    if kind is None:
        raise field_error(("input", index), "an item needs a type (or a role, for a message)")
    if kind not in INPUT_ITEM_TYPES:
        kinds = ", ".join(INPUT_ITEM_TYPES)
        raise field_error(("input", index, "type"), f"{kind!r} items are not supported: {kinds}")
    return {**item, "type": kind}


# --- the response object -------------------------------------------------------------------


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class OutputReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(ResponseModel):
    """The reply's reasoning (server/reasoning.py), as its text: no summary is written."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: ItemStatus


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str
    message: str


class ResponseObject(ResponseModel):
    """A response as OpenAI writes one. `temperature` and `top_p` are the values used
    (a request's, else the defaults in force); `text`, `tools` and `tool_choice` echo the
    request's in the API's own shape."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] | None = None


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
