"""The output items of one response, and the stream events that build them: the one place
where `/v1/responses` makes items, for a streamed response and a whole one alike (a whole
one is built the same way and its events dropped).

A reply is its reasoning (when the model reasons), its text, then its function calls.
The reasoning becomes one `reasoning` item, opened at its first text and streamed as
`reasoning_text` deltas; the text one assistant message after it, streamed as
`output_text` deltas (the reasoning item is closed when the text begins: the reasoning
always comes first); the calls, read whole once the reply ends, one `function_call` item
each, after the message. A reply with neither text nor calls has an empty message.
`Reply` splits a reply's text so (server/reasoning.py, then the tool-call parser) and
makes its items with `OutputItems`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from server.chat_protocol import ResponseToolCall
from server.reasoning import ReasoningStream
from server.responses.protocol import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
)

if TYPE_CHECKING:
    from engine.outputs import CompletionOutput
    from server.conversation import CallStream

Event = dict[str, Any]  # a stream event without its sequence number
Part = OutputText | OutputReasoningText


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Invariants: `items[i]` has output index i; at most one reasoning item, first; at
    most one message, after it and before the calls; an item's events all come before the
    next item's; each method returns the events of what it added, in order."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._reasoning: OutputReasoning | None = None
        self._message: OutputMessage | None = None

    def reasoning(self, delta: str) -> list[Event]:
        """Append `delta` to the reasoning item's text (opening the item first)."""
        if not delta:
            return []
        assert self._message is None, "the reasoning comes before the text"
        events: list[Event] = []
        if self._reasoning is None:
            self._reasoning = OutputReasoning(
                id=new_item_id("rs"), status="in_progress", content=[OutputReasoningText(text="")]
            )
            events += self._open(self._reasoning, OutputReasoningText(text=""))
        return events + self._delta(self._reasoning, "reasoning_text", delta)

    def text(self, delta: str) -> list[Event]:
        """Append `delta` to the message's text (closing the reasoning and opening the
        message first)."""
        if not delta:
            return []
        events = [] if self._message is not None else self._open_message("completed")
        assert self._message is not None
        return events + self._delta(self._message, "output_text", delta)

    def finish(
        self, rest: str, calls: Sequence[ResponseToolCall], status: ItemStatus
    ) -> list[Event]:
        """The reply ended with `rest` of its text and `calls`: close the reasoning and
        the message (with `status`; an empty message if the reply has neither text nor
        calls) and add the calls."""
        events = self.text(rest)
        if self._message is None and not calls:
            events += self._open_message(status)
        if self._message is not None:
            events += self._close(self._message, "output_text", status)
        elif self._reasoning is not None:
            events += self._close(self._reasoning, "reasoning_text", status)
        for call in calls:
            events += self._add_call(call)
        return events

    def _open_message(self, reasoning_status: ItemStatus) -> list[Event]:
        """Close the reasoning, if any, with `reasoning_status`; open the message."""
        events: list[Event] = []
        if self._reasoning is not None:
            events += self._close(self._reasoning, "reasoning_text", reasoning_status)
        self._message = OutputMessage(
            id=new_item_id("msg"), status="in_progress", content=[OutputText(text="")]
        )
        return events + self._open(self._message, OutputText(text=""))

    def _open(self, item: OutputReasoning | OutputMessage, part: Part) -> list[Event]:
        """Add `item`, in progress, whose one content part (`part`, empty) opens with it."""
        self.items.append(item)
        opened = item.model_copy(update={"content": []})
        return [
            {"type": "response.output_item.added", **self._index(item), "item": opened},
            {
                "type": "response.content_part.added",
                **self._where(item),
                "content_index": 0,
                "part": part,
            },
        ]

    def _delta(self, item: OutputReasoning | OutputMessage, kind: str, delta: str) -> list[Event]:
        """Append `delta` to `item`'s part, of type `kind`."""
        item.content[0].text += delta
        event = {"type": f"response.{kind}.delta", **self._where(item), "content_index": 0}
        return [{**event, "delta": delta, **_logprobs(kind)}]

    def _close(
        self, item: OutputReasoning | OutputMessage, kind: str, status: ItemStatus
    ) -> list[Event]:
        item.status = status
        part = item.content[0]
        where = self._where(item)
        return [
            {
                "type": f"response.{kind}.done",
                **where,
                "content_index": 0,
                "text": part.text,
                **_logprobs(kind),
            },
            {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            {"type": "response.output_item.done", **self._index(item), "item": item},
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


class Reply:
    """One reply's text made into output items (`output`) as it comes: split into its
    reasoning and its answer (with `thoughts`, when the model reasons), the answer into
    text and calls (with `calls`, when tools are on). Fed the whole text at once, it
    builds the items it builds piece by piece."""

    def __init__(self, thoughts: ReasoningStream | None, calls: CallStream | None) -> None:
        self.output = OutputItems()
        self._thoughts = thoughts
        self._calls = calls

    def feed(self, text: str) -> list[Event]:
        """The events of this much more of the reply's text."""
        reasoning, answer = ("", text) if self._thoughts is None else self._thoughts.feed(text)
        events = self.output.reasoning(reasoning)
        return events + self.output.text(
            answer if self._calls is None else self._calls.feed(answer)
        )

    def finish(self, completion: CompletionOutput) -> list[Event]:
        """The events that end the reply: its held-back text, then its calls."""
        reasoning, rest = ("", "") if self._thoughts is None else self._thoughts.finish()
        events = self.output.reasoning(reasoning)
        calls: list[ResponseToolCall] = []
        if self._calls is not None:
            rest = self._calls.feed(rest)
            more, calls = self._calls.finish()
            rest += more
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        return events + self.output.finish(rest, calls, status)


def _logprobs(kind: str) -> dict[str, Any]:
    """The `logprobs` an event of a part of type `kind` carries: output text's (none are
    sampled: empty), reasoning text's none."""
    return {"logprobs": []} if kind == "output_text" else {}
