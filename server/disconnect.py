"""Cancel a non-streaming request's work as soon as its client disconnects.

Without this, a client that gives up on a long completion would leave the engine
generating (and holding KV blocks) for nobody until `max_tokens`. Streaming responses
need no watcher: Starlette cancels the stream when the client goes (see streaming.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from server.errors import ClientDisconnected

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Cancelling `work` cancels the engine generators it iterates, which aborts their
    requests and frees their blocks before this returns.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by now, so the server's next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
