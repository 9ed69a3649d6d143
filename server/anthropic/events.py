"""The server-sent events of a streamed Anthropic message, framed as Anthropic frames
them: `event: <type>` and `data: <JSON>`, the JSON's `type` the event's.

A stream is `message_start`, a `ping`, then per content block `content_block_start`,
its deltas and `content_block_stop`, then `message_delta` (the stop reason and the
usage) and `message_stop`; or, once something failed, an `error` event ends it.
"""

from __future__ import annotations

import json
from typing import Any

from server.anthropic.protocol import ThinkingOut, ToolUseOut
from server.streaming import one_line

PING = {"type": "ping"}


def event(data: dict[str, Any]) -> str:
    """One event, its data one line whatever its text holds."""
    return f"event: {data['type']}\ndata: {one_line(json.dumps(data, ensure_ascii=False))}\n\n"


class ContentBlocks:
    """The content-block events of one streamed reply.

    Invariants: blocks are numbered from 0 in the order they open; at most one is open,
    and a block opens when content of another kind than the open one's comes (thinking,
    text, a tool use), closing the open one; `close` closes the last.
    """

    def __init__(self) -> None:
        self._open: str | None = None
        self._index = -1

    def thinking(self, text: str, shown: bool = True) -> list[str]:
        """Events for reasoning text; with `shown` false, the block is opened but its
        text left out (Anthropic's `display: omitted`)."""
        events = self._start("thinking", ThinkingOut(thinking="").model_dump())
        if text and shown:
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return events

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = self._start("text", {"type": "text", "text": ""})
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def tool_use(self, block: ToolUseOut) -> list[str]:
        """A whole call: its block opens with an empty input, which one delta then fills."""
        events = self._start("tool_use", {**block.model_dump(), "input": {}})
        arguments = json.dumps(block.input, ensure_ascii=False)
        events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event({"type": "content_block_stop", "index": self._index})]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        """Open a block of `kind` unless one is open (every tool use is a block of its own)."""
        if self._open == kind and kind != "tool_use":
            return []
        events = self.close()
        self._open = kind
        self._index += 1
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [*events, event(start)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self._index, "delta": delta})
