"""A Responses request as the chat completion request that asks the same: the adapter
that lets `/v1/responses` share chat's whole path (the chat template, tool grammars and
parsers, sampling) instead of being a second one.

The conversation is the stored one before it (`previous_response_id`: that response's
input items and output), then the request's own `input`; `instructions` become the
system message in front (they are never carried over from an earlier response, as in
OpenAI's API). Items map onto chat messages: a message onto a message of its role,
function calls onto one assistant message's `tool_calls` (the one with the text before
them, when the model wrote both), an output onto a `tool` message. Reasoning items stay
in the conversation but are not rendered (see docs/responses.md).
"""

from __future__ import annotations

from typing import Any

from server.errors import invalid_request
from server.protocol import ChatCompletionRequest
from server.responses_protocol import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputItem,
    MessageItem,
    ResponsesRequest,
)


def stored_items(
    conversation: list[dict[str, Any]], output: list[dict[str, Any]]
) -> list[InputItem]:
    """A stored response's conversation followed by its output, as input items."""
    return INPUT_ITEMS.validate_python(conversation + output)


def as_chat_request(
    body: ResponsesRequest, items: list[InputItem], first_new: int
) -> ChatCompletionRequest:
    """The chat request for `body` over the conversation `items`, of which those from
    `first_new` on are the request's `input`. A 400 names the input item at fault: an
    output whose call is nowhere before it, or an empty conversation."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    calls: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise invalid_request(
                    f"input[{index - first_new}].call_id: no function_call with call_id "
                    f"{item.call_id!r} comes before this output",
                    f"input[{index - first_new}].call_id",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if not messages:
        raise invalid_request("input: the conversation is empty: give a message", "input")
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": messages,
            "n": 1,
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": _chat_tools(body),
            "tool_choice": _chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body),
            "priority": body.priority,
        }
    )


def _chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    return [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in body.tools
    ]


def _chat_tool_choice(choice: str | FunctionChoice | None) -> Any:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text_format
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = fmt.model_dump(include={"name", "schema_", "description", "strict"}, by_alias=True)
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }
