"""The output items of one response, and the stream events that build them: the one place
where `/v1/responses` makes items, for a streamed response and a whole one alike (a whole
one is built the same way and its events dropped).

A reply is its text, then its function calls. The text becomes one assistant message,
opened at its first text and streamed as `output_text` deltas; the calls, read whole once
the reply ends, become one `function_call` item each, after the message. A reply with
neither is an empty message. (A reasoning item, once the server parses reasoning, would
be opened before the message in the same way.)
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from server.protocol import ResponseToolCall
from server.responses_protocol import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
)

Event = dict[str, Any]  # a stream event without its sequence number


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Invariants: `items[i]` has output index i; at most one message, which precedes
    the calls; each method returns the events of what it added, in order."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None

    def text(self, delta: str) -> list[Event]:
        """Append `delta` to the message's text (opening the message first)."""
        if not delta:
            return []
        events = [] if self._message is not None else self._open_message()
        assert self._message is not None
        part = self._message.content[0]
        part.text += delta
        events.append(
            {
                "type": "response.output_text.delta",
                **self._where(self._message),
                "content_index": 0,
                "delta": delta,
                "logprobs": [],
            }
        )
        return events

    def finish(
        self, rest: str, calls: Sequence[ResponseToolCall], status: ItemStatus
    ) -> list[Event]:
        """The reply ended with `rest` of its text and `calls`: close the message (with
        `status`; an empty one if the reply has neither text nor calls) and add the calls."""
        events = self.text(rest)
        if self._message is None and not calls:
            events += self._open_message()
        if self._message is not None:
            events += self._close_message(self._message, status)
        for call in calls:
            events += self._add_call(call)
        return events

    def _open_message(self) -> list[Event]:
        message = OutputMessage(
            id=new_item_id("msg"), status="in_progress", content=[OutputText(text="")]
        )
        self._message = message
        self.items.append(message)
        opened = message.model_copy(update={"content": []})
        return [
            {"type": "response.output_item.added", **self._index(message), "item": opened},
            {
                "type": "response.content_part.added",
                **self._where(message),
                "content_index": 0,
                "part": OutputText(text=""),
            },
        ]

    def _close_message(self, message: OutputMessage, status: ItemStatus) -> list[Event]:
        message.status = status
        part = message.content[0]
        where = self._where(message)
        return [
            {
                "type": "response.output_text.done",
                **where,
                "content_index": 0,
                "text": part.text,
                "logprobs": [],
            },
            {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            {"type": "response.output_item.done", **self._index(message), "item": message},
        ]

    def _add_call(self, call: ResponseToolCall) -> list[Event]:
        item = OutputFunctionCall(
            id=new_item_id("fc"),
            status="completed",
            call_id=call.id,
            name=call.function.name,
            arguments=call.function.arguments,
        )
        self.items.append(item)
        opened = item.model_copy(update={"status": "in_progress", "arguments": ""})
        where = self._where(item)
        return [
            {"type": "response.output_item.added", **self._index(item), "item": opened},
            {"type": "response.function_call_arguments.delta", **where, "delta": item.arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": item.name,
                "arguments": item.arguments,
            },
            {"type": "response.output_item.done", **self._index(item), "item": item},
        ]

    def _index(self, item: OutputItem) -> dict[str, int]:
        return {"output_index": next(i for i, kept in enumerate(self.items) if kept is item)}

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, **self._index(item)}
