"""Server-sent events: how chunks are framed, and a response that always closes its stream.

Starlette stops iterating a stream when the client disconnects (it cancels the iteration,
or the next send fails), but it never closes the abandoned async generator, which would
leave the engine request running until garbage collection. `SSEResponse` closes it
itself, so the engine generators inside are closed and their requests aborted at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One `data:` event; JSON never holds a raw newline, so one line always suffices."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response over an async generator of already framed events."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None
    ) -> None:
        """`on_close` runs once the response is over, however it ended (even when the
        generator never started, so its own `finally` never ran)."""
        # Proxies must not buffer a token stream.
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
