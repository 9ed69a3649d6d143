"""Streams of an API request: server-sent events and the merging of several async streams.

A stream leaves as server-sent events (`sse`, `DONE`, `SSEResponse`). Starlette stops
iterating a stream when the client disconnects (it cancels the iteration, or the next send
fails), but it never closes the abandoned async generator, which would leave the engine
request running until garbage collection. `SSEResponse` closes it itself, so the engine
generators inside are closed and their requests aborted at once.

`merge_streams` interleaves several streams (one per prompt of a request) as their items
arrive, and `next_before` bounds the wait for the next item by the request's deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:
    from server.admission import Deadline

T = TypeVar("T")


DONE = "data: [DONE]\n\n"

# Characters JSON may leave raw that line splitters other than SSE's own break lines at
# (Python's `str.splitlines`, httpx's `iter_lines`); escaped, the JSON means the same.
_LINE_SEPARATORS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(json_text: str) -> str:
    """`json_text` as one line for every line splitter: JSON never holds a raw newline or
    carriage return, and this escapes the Unicode line separators it may hold."""
    return json_text.translate(_LINE_SEPARATORS)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One `data:` event of one line, whatever the payload's text holds."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {one_line(data)}\n\n"


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


async def next_before(items: AsyncIterator[T], deadline: Deadline | None) -> T:
    """The next item, or TimeoutError once `deadline` has passed. On a timeout while
    waiting, the cancellation reaches `items`, which ends (a `merge_streams` aborts)."""
    if deadline is None:
        return await anext(items)
    remaining = deadline.remaining()
    if remaining <= 0:
        raise TimeoutError
    async with asyncio.timeout(remaining):
        return await anext(items)


@dataclass(slots=True)
class _Ended:
    error: Exception | None


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield `(index of the stream, item)` from all `streams` concurrently.

    Each stream is consumed by its own task. When this generator ends (exhausted, closed,
    cancelled, or re-raising the first error of a stream) every task has been cancelled
    and awaited, so each stream still running has seen the cancellation: an engine
    stream aborts its request then.
    """
    arrivals: asyncio.Queue[tuple[int, T] | _Ended] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                arrivals.put_nowait((index, item))
        except Exception as exc:
            arrivals.put_nowait(_Ended(exc))
        else:
            arrivals.put_nowait(_Ended(None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            arrival = await arrivals.get()
            if isinstance(arrival, _Ended):
                if arrival.error is not None:
                    raise arrival.error
                running -= 1
            else:
                yield arrival
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
