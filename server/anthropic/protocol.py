"""Anthropic's Messages wire format: request bodies (validated) and response bodies.

As strict and closed as the OpenAI models (server/protocol.py): a field a model declares
is honoured; `IGNORED_FIELDS` cannot change the output and are accepted at any depth;
`REFUSED_FIELDS` are Anthropic's fields this server does not implement, a 400 naming
them (with the reason) unless sent as null; any other field is a 400 naming it.
Content blocks are text, `tool_use`, `tool_result`, `thinking` and `redacted_thinking`;
a block of another type is a 400 naming its `type`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, model_validator

from server.config import KeepAlive
from server.protocol import RequestBody, RequestModel, check_type, field_error

IGNORED_FIELDS: dict[str, str] = {
    "metadata": "an end-user id for the provider's abuse monitoring",
    "service_tier": "the provider's processing tier",
    "cache_control": "a prompt-cache breakpoint (prefix caching is automatic)",
    "inference_geo": "where the provider runs the request",
    "speed": "the provider's processing speed",
}
REFUSED_FIELDS: dict[str, str] = {
    "container": "server-side tools and their containers are not available",
    "mcp_servers": "MCP connectors are not available",
    "context_management": "context editing is not implemented",
    "diagnostics": "prompt-cache diagnostics are not reported",
    "citations": "citations are not implemented",
    "input_examples": "tool input examples are not implemented",
    "effort": "effort controls are not implemented",
}
# How a reply's reasoning is returned: as thinking blocks, as thinking blocks without
# their text, or not at all.
ThinkingDisplay = Literal["shown", "omitted", "dropped"]
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class _Model(RequestModel):
    IGNORED_FIELDS: ClassVar[Mapping[str, str]] = IGNORED_FIELDS
    REFUSED_FIELDS: ClassVar[Mapping[str, str]] = REFUSED_FIELDS


class _Body(RequestBody):
    IGNORED_FIELDS: ClassVar[Mapping[str, str]] = IGNORED_FIELDS
    REFUSED_FIELDS: ClassVar[Mapping[str, str]] = REFUSED_FIELDS


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    """A call an assistant made, its `input` an object."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Model):
    """The result of the call `tool_use_id`, in the user message after the call."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(_Model):
    """An assistant's earlier reasoning, passed back; `signature` is opaque."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
ContentBlock = Annotated[Block, Discriminator("type")]
# Which role may send which blocks.
_ROLE_BLOCKS = {
    "user": {"text", "tool_result"},
    "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
}


class Message(_Model):
    """Invariants: every block's type is one this server reads, and one its role may send
    (`tool_result` in user messages; `tool_use` and thinking in assistant ones)."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            return data
        for i, block in enumerate(data["content"]):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise field_error(
                    ("content", i, "type"),
                    f"{kind!r} content blocks are not supported: this server reads "
                    f"{', '.join(BLOCK_TYPES)} blocks",
                )
        return data

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        for i, block in enumerate(self.blocks()):
            if block.type not in _ROLE_BLOCKS[self.role]:
                raise field_error(
                    ("content", i, "type"), f"a {self.role} message cannot hold {block.type} blocks"
                )
        return self

    def blocks(self) -> list[Block]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(_Model):
    """A client tool; Anthropic's server tools (`web_search_...`) are not available."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None  # calls always match their schema

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        message = "{kind}: server tools are not available, only custom ones"
        return check_type(data, ("custom",), message)


class ToolChoice(_Model):
    """`auto` (the default with tools), `any` (some call), `tool` (a call of `name`), or
    `none`; `disable_parallel_tool_use` allows one call only."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.name is None) == (self.type == "tool"):
            raise field_error("name", "required with type tool, and only with it")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise field_error("disable_parallel_tool_use", "not allowed with type none")
        return self


class ThinkingConfig(_Model):
    """`enabled` or `adaptive`: the reply's reasoning comes back in thinking blocks (the
    model reasons as its chat template makes it; `budget_tokens` must be below max_tokens
    and is a target, not enforced); `disabled`: no thinking blocks are asked for, and the
    chat template gets `enable_thinking: false` (server/anthropic/conversation.py).
    `display: omitted` sends thinking blocks with empty text."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if (self.budget_tokens is None) == (self.type == "enabled"):
            raise field_error("budget_tokens", "required with type enabled, and only with it")
        if self.type == "disabled" and self.display is not None:
            raise field_error("display", "not allowed with type disabled")
        return self


class JsonOutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    """`format`: the reply's text must be JSON matching the schema (enforced by the
    grammar engine, as chat's `response_format`)."""

    format: JsonOutputFormat | None = None


class _Conversation(_Body):
    """What `/v1/messages` and its `count_tokens` both read."""

    model: str
    # Ollama's: how long the model stays loaded after this request (server/model_pool.py).
    keep_alive: KeepAlive | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _tools_named_once(self) -> _Conversation:
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "tool names must be distinct")
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not self.tools:
            raise field_error("tool_choice", f"type {choice.type} needs tools")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise field_error(("tool_choice", "name"), f"names {choice.name!r}, not a tool")
        forced = choice is not None and choice.type in ("any", "tool")
        if forced and self.output_config is not None and self.output_config.format is not None:
            raise field_error(
                ("output_config", "format"), "cannot be combined with a tool_choice forcing a call"
            )
        return self

    @model_validator(mode="after")
    def _results_answer_calls(self) -> _Conversation:
        """Each tool_result answers a tool_use of the assistant message just before it,
        and each tool_use is answered in the user message just after; the conversation
        ends with a user message (continuing an assistant's reply is not supported)."""
        if self.messages[-1].role == "assistant":
            raise field_error(
                ("messages", len(self.messages) - 1, "role"),
                "a final assistant message (continuing its reply) is not supported",
            )
        calls: set[str] = set()  # the ids of the previous message's calls
        for i, message in enumerate(self.messages):
            blocks = message.blocks()
            answered = {b.tool_use_id: j for j, b in enumerate(blocks) if b.type == "tool_result"}
            for call_id, j in answered.items():
                if call_id not in calls:
                    raise field_error(
                        ("messages", i, "content", j, "tool_use_id"),
                        f"{call_id!r} answers no tool_use block of the message before it",
                    )
            if calls - answered.keys():
                missing = ", ".join(sorted(calls - answered.keys()))
                raise field_error(
                    ("messages", i, "content"),
                    f"needs a tool_result block for each tool_use of the message before it; "
                    f"none answers {missing}",
                )
            calls = {b.id for b in blocks if b.type == "tool_use"}
        return self

    def thinking_display(self) -> ThinkingDisplay:
        """`thinking` left out: the model's reasoning, if it reasons, is shown (it is the
        model's, not the request's, to decide); `disabled`: it is dropped."""
        if self.thinking is None:
            return "shown"
        if self.thinking.type == "disabled":
            return "dropped"
        return "omitted" if self.thinking.display == "omitted" else "shown"

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class MessagesRequest(_Conversation):
    """POST /v1/messages: `max_tokens` is required, as Anthropic's API requires it."""

    max_tokens: int = Field(json_schema_extra={"minimum": 1})
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # An extension, as on the OpenAI endpoints: vLLM's request priority (a lower value is
    # served first under the priority scheduling policy).
    priority: int | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise field_error(
                ("thinking", "budget_tokens"), f"must be below max_tokens ({self.max_tokens})"
            )
        return self


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the conversation alone."""


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageUsage(_Response):
    """`input_tokens` are the prompt's tokens the prefix cache did not hold;
    `cache_read_input_tokens` those it held (Anthropic counts them apart)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextOut(_Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(_Response):
    input_tokens: int
