"""A chat-shaped request's conversation as the chat template renders it: what
`/v1/chat/completions`, `/v1/responses`, `/v1/messages` and `/tokenize` tokenize, and
what the scale-out ingress renders to predict their prompts.

A conversation of plain messages (no tools offered, no earlier calls or their results)
is rendered here, and the tools room is not imported. Anything about tools goes through
`ToolCalling`, which the room implements (server/tool_calling.py); a request that needs
it where the room cannot be imported is refused with a ValueError that names `tools`
(or `messages`, for earlier calls), which `user_errors` turns into a 400.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.protocol import ChatMessage
from server.tool_calling import OfferedTools, ToolCalling, ToolRequest, has_tool_turns


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
    room's, or None where it cannot be imported) is called only when tools are offered or
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
