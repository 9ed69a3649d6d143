"""A chat-shaped request's conversation as the chat template renders it: what
`/v1/chat/completions`, `/v1/responses`, `/v1/messages` and `/tokenize` tokenize, and
what the scale-out ingress renders to predict their prompts; and tool calling as the core
sees it.

A conversation of plain messages (no tools offered, no earlier calls or their results)
is rendered here, and the tools component (`server/tools/`) is not imported. The core knows
what a request asks (`ToolRequest`: its functions, which of them a reply must call,
whether several calls are allowed) and what comes back (`ResponseToolCall`s). How the
served model writes calls, how tools are rendered into its prompt, the grammar that holds
a call to its schema and the parsing of calls out of its text are the component's, behind its
entry point (`server.capabilities.tool_calling`) and the interfaces below: `ToolCalling` for the
server, `OfferedTools` for one request, `CallStream` for one streamed reply. A request
that needs the component where it cannot be imported is refused with a ValueError that names
`tools` (or `messages`, for earlier calls), which `user_errors` turns into a 400.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from server.chat_protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice

if TYPE_CHECKING:
    from engine.sampling.params import StructuredOutputs
    from server.chat_protocol import ResponseToolCall


@dataclass(frozen=True, slots=True)
class Conversation:
    """The chat template's inputs: `messages`, its `tools` argument and its other
    variables; and `tools`, the request's offered tools (None: the reply is all text).
    Invariant: `template_tools` is None whenever `tools` is."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    variables: dict[str, Any] | None
    tools: OfferedTools | None


def plain_message(message: ChatMessage) -> dict[str, Any]:
    """A message as the template reads it, without any tool call or result."""
    result: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        result["name"] = message.name
    return result


def render(
    messages: list[ChatMessage],
    request: ToolRequest | None,
    variables: dict[str, Any] | None,
    tool_calling: Callable[[], ToolCalling | None],
) -> Conversation:
    """The conversation of `messages` offering `request`'s tools. `tool_calling` (the
    component's, or None where it cannot be imported) is called only when tools are offered or
    the messages hold earlier calls; ValueError when it is then None."""
    if request is None and not has_tool_turns(messages):
        return Conversation([plain_message(m) for m in messages], None, variables, None)
    calling = tool_calling()
    if calling is None:
        param = "messages" if request is None else "tools"
        what = "holds tool calls or results" if request is None else "offers tools"
        raise ValueError(
            f"{param}: this request {what}, and this server has no tool calling "
            "(server.tools cannot be imported here)"
        )
    if request is None:
        return Conversation(calling.conversation(messages), None, variables, None)
    tools = calling.offer(request)
    return Conversation(tools.conversation(messages), tools.template_tools(), variables, tools)


@dataclass(frozen=True, slots=True)
class Function:
    """A tool the request offers: `parameters` is its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            spec["description"] = self.description
        return {"type": "function", "function": spec}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools one request offers. `forced` are the functions the reply must call one
    of (all of them for `required`, one for a named choice), None when the model may
    answer in text; `parallel` allows several calls in one reply (never for a named
    choice, which asks for one call of that function)."""

    functions: list[Function]
    forced: list[Function] | None
    parallel: bool

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolRequest | None:
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


def has_tool_turns(messages: Iterable[ChatMessage]) -> bool:
    """Whether a conversation holds earlier tool calls or their results, which only the
    tools component can render for every chat template."""
    return any(m.tool_calls or m.role == "tool" for m in messages)


class CallStream(Protocol):
    """One streamed reply's text, split into content to send now and calls to hold.

    Invariant: `feed` returns only text that can no longer turn out to be part of a call;
    the rest waits for `finish`."""

    def feed(self, delta: str) -> str:
        """More of the reply's text in; the content that may be sent out."""

    def finish(self) -> tuple[str, list[ResponseToolCall]]:
        """The content not yet sent, and the calls read from the whole text."""


class OfferedTools(Protocol):
    """One request's tools, bound to how the served model writes calls."""

    @property
    def forced(self) -> bool:
        """Whether the reply must be calls (`required` or a named choice)."""

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as the chat template reads them, the tools described in them
        where the template ignores its `tools` argument."""

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The chat template's `tools` argument, None where the template takes none."""

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar of the reply: calls only when forced, else free text in which a
        begun call is held to the tools' schemas."""

    def response_calls(self, text: str) -> tuple[str | None, list[ResponseToolCall]]:
        """A whole reply's content and calls."""

    def stream(self) -> CallStream:
        """The splitter of one streamed reply."""


class ToolCalling(Protocol):
    """How the served model reads and writes tool calls (the `tool_call_parser` setting)."""

    def offer(self, request: ToolRequest) -> OfferedTools:
        """`request`'s tools, bound to this server's call format."""

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages of a request that offers no tools, its earlier calls and their
        results written as this chat template reads them."""
