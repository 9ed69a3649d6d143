"""A Responses request as the chat completion request that asks the same: the adapter
that lets `/v1/responses` share chat's whole path (the chat template, tool grammars and
parsers, sampling) instead of being a second one.

The conversation is the stored one before it (`previous_response_id`: that response's
input items and output), then the request's own `input`; `instructions` become the
system message in front (they are never carried over from an earlier response, as in
OpenAI's API). Items map onto chat messages: a message onto a message of its role,
function calls onto one assistant message's `tool_calls` (the one with the text before
them, when the model wrote both), an output onto a `tool` message. Reasoning items stay
in the conversation but are not rendered, as reasoning models' chat templates leave out
the reasoning of earlier turns (see docs/responses.md). `reasoning` is honoured where it
can be (`thinking_variables`) and refused by name where not.
"""

from __future__ import annotations

from typing import Any

from server.chat_protocol import ChatCompletionRequest
from server.errors import invalid_request
from server.reasoning import ReasoningSyntax
from server.responses.protocol import (
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


# The efforts that turn thinking off; no other effort can be told from the model's own.
_THINKING_OFF = ("none", "minimal")


def thinking_variables(
    body: ResponsesRequest, syntax: ReasoningSyntax | None, chat_template: str | None
) -> dict[str, Any] | None:
    """The chat template variables that honour `body.reasoning` (`enable_thinking`
    false for an effort of `none` or `minimal`; none otherwise). A 400 names what cannot
    be honoured: any `reasoning` for a model that does not reason (`syntax` None), an
    effort that turns thinking off where the template cannot (it reads no
    `enable_thinking`), any other effort (how much a model thinks is its own doing)."""
    asked = body.reasoning
    if asked is None:
        return None
    if syntax is None:
        reason = "this server's model does not reason, so reasoning settings do not apply"
        raise invalid_request(f"reasoning: not supported: {reason}", "reasoning")
    if asked.effort is None:
        return None
    if asked.effort not in _THINKING_OFF:
        reason = (
            "how much the model reasons is its own doing; leave effort out, or send "
            "'none' or 'minimal' to turn its thinking off"
        )
        raise invalid_request(
            f"reasoning.effort: {asked.effort!r} is not supported: {reason}", "reasoning.effort"
        )
    if "enable_thinking" not in (chat_template or ""):
        reason = "the model's chat template cannot turn its thinking off (enable_thinking)"
        raise invalid_request(
            f"reasoning.effort: {asked.effort!r} is not supported: {reason}", "reasoning.effort"
        )
    return {"enable_thinking": False}


def as_chat_request(
    body: ResponsesRequest,
    items: list[InputItem],
    first_new: int,
    variables: dict[str, Any] | None = None,
) -> ChatCompletionRequest:
    """The chat request for `body` over the conversation `items`, of which those from
    `first_new` on are the request's `input`, with the chat template's `variables`
    (`thinking_variables`). A 400 names the input item at fault: an output whose call is
    nowhere before it, a call no output after it answers, or an empty conversation."""
    messages = _chat_messages(body.instructions, items, first_new)
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
            "chat_template_kwargs": variables,
        }
    )


def _chat_messages(
    instructions: str | None, items: list[InputItem], first_new: int
) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and the conversation `items` (those from
    `first_new` on are the request's `input`): consecutive calls join one assistant
    message; a 400 for an output whose call is nowhere before it or a call no output
    after it answers."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    calls: dict[str, int] = {}  # call_id -> the index of its call, while unanswered
    answered: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            calls[item.call_id] = index
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
            if item.call_id not in calls and item.call_id not in answered:
                raise invalid_request(
                    f"input[{index - first_new}].call_id: no function_call with call_id "
                    f"{item.call_id!r} comes before this output",
                    f"input[{index - first_new}].call_id",
                )
            calls.pop(item.call_id, None)
            answered.add(item.call_id)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if calls:
        call_id, index = next(iter(calls.items()))
        raise _unanswered(call_id, index - first_new)
    return messages


def _unanswered(call_id: str, position: int) -> Exception:
    """The 400 of a function_call no function_call_output answers, as OpenAI words it;
    `position` < 0: the call is in the stored conversation before the input."""
    where = f"input[{position}]" if position >= 0 else "the previous response's output"
    return invalid_request(
        f"input: no tool output found for function call {call_id!r} ({where}): give a "
        f"function_call_output item with call_id {call_id!r} after it",
        f"input[{position}]" if position >= 0 else "input",
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
