"""An Anthropic conversation as the chat path reads it: chat messages, tools, and the
reply's content blocks read back out of the model's text.

The adapter is thin on purpose: the messages become the chat endpoint's messages (the
system prompt a system message; a `tool_use` an assistant's tool call; each
`tool_result` a tool message, before the user's text; earlier thinking is left out, as
reasoning models' chat templates leave it out), and the tools the chat endpoint's
tools, so the same template renders them, the same grammar holds the calls and the same
parser reads them.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from server.anthropic.protocol import (
    Message,
    MessagesRequest,
    TextOut,
    ThinkingDisplay,
    ThinkingOut,
    ToolUseOut,
)
from server.chat_protocol import ChatMessage, FunctionCall, ToolCall
from server.conversation import (
    Conversation,
    Function,
    OfferedTools,
    ToolCalling,
    ToolRequest,
    render,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from server.anthropic.protocol import CountTokensRequest


def tool_request(body: MessagesRequest | CountTokensRequest) -> ToolRequest | None:
    """The request's tools as chat's (None when it offers none, or `tool_choice: none`)."""
    if not body.tools or (body.tool_choice is not None and body.tool_choice.type == "none"):
        return None
    functions = [Function(t.name, t.description, t.input_schema) for t in body.tools]
    choice = body.tool_choice
    parallel = choice is None or not choice.disable_parallel_tool_use
    if choice is None or choice.type == "auto":
        return ToolRequest(functions, None, parallel)
    if choice.type == "any":
        return ToolRequest(functions, functions, parallel)
    return ToolRequest(functions, [f for f in functions if f.name == choice.name], parallel)


def conversation(
    body: MessagesRequest | CountTokensRequest,
    tool_calling: Callable[[], ToolCalling | None],
) -> Conversation:
    """The conversation the chat template renders for `body` (ValueError naming `tools`
    or `messages` where it needs tool calling and the server has none): `thinking`
    disabled is `enable_thinking: false`, which turns the thinking of templates that read
    it (Qwen3's) off."""
    messages: list[ChatMessage] = []
    system = body.system_text()
    if system is not None:
        messages.append(ChatMessage(role="system", content=system))
    for message in body.messages:
        messages.extend(_chat_messages(message))
    disabled = body.thinking is not None and body.thinking.type == "disabled"
    variables: dict[str, Any] | None = {"enable_thinking": False} if disabled else None
    return render(messages, tool_request(body), variables, tool_calling)


def _chat_messages(message: Message) -> list[ChatMessage]:
    blocks = message.blocks()
    text = "\n".join(b.text for b in blocks if b.type == "text")
    if message.role == "assistant":
        calls = [
            ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
            for b in blocks
            if b.type == "tool_use"
        ]
        content = text if text or not calls else None
        return [ChatMessage(role="assistant", content=content, tool_calls=calls or None)]
    results = [
        ChatMessage(
            role="tool",
            tool_call_id=b.tool_use_id,
            content=f"Error: {b.text()}" if b.is_error else b.text(),
        )
        for b in blocks
        if b.type == "tool_result"
    ]
    if text or not results:
        results.append(ChatMessage(role="user", content=text))
    return results


def reply_blocks(
    reasoning: str | None,
    answer: str,
    tools: OfferedTools | None,
    display: ThinkingDisplay,
) -> list[TextOut | ThinkingOut | ToolUseOut]:
    """A reply's content: its thinking as `display` says, its text, and its calls read
    from the answer."""
    blocks: list[TextOut | ThinkingOut | ToolUseOut] = []
    if reasoning and display != "dropped":
        blocks.append(ThinkingOut(thinking=reasoning if display == "shown" else ""))
    content: str | None = answer
    uses: list[ToolUseOut] = []
    if tools is not None:
        content, calls = tools.response_calls(answer)
        uses = [tool_use(call.function.name, call.function.arguments) for call in calls]
    if content:
        blocks.append(TextOut(text=content))
    return [*blocks, *uses]


def tool_use(name: str, arguments: str) -> ToolUseOut:
    """A call as a tool_use block, with a fresh id; `arguments` is a JSON object's text."""
    return ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=name, input=json.loads(arguments))
