"""Interleave several async streams, as items arrive, into one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


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
