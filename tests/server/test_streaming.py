"""The streaming machinery of server/streaming.py, directly: `sse` framing, `SSEResponse`
over a real HTTP stream, and `merge_streams`' ordering, errors and cancellation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from server.anthropic.events import event as anthropic_event
from server.responses.routes import _Numbered
from server.streaming import DONE, SSEResponse, merge_streams, sse


class Chunk(BaseModel):
    text: str


TEXT = "two\nlines\r\nand \u2028, \u2029 and \x85 separators"


def test_an_event_is_one_data_line_whatever_its_text_holds():
    for payload in (Chunk(text=TEXT), {"text": TEXT}):
        event = sse(payload)
        assert event.startswith("data: ") and event.endswith("\n\n")
        [line] = event[:-2].splitlines()  # every separator str.splitlines and httpx break at
        assert json.loads(line.removeprefix("data: "))["text"] == TEXT
    assert DONE == "data: [DONE]\n\n"


def test_anthropic_and_responses_events_are_one_data_line_whatever_their_text_holds():
    for framed in (
        anthropic_event({"type": "x", "text": TEXT}),
        _Numbered().sse({"type": "x", "text": TEXT}),
    ):
        head, data = framed[:-2].splitlines()
        assert head == "event: x" and json.loads(data.removeprefix("data: "))["text"] == TEXT


def test_a_stream_is_served_as_event_stream_and_closed_once():
    closed: list[str] = []

    async def events() -> AsyncGenerator[str, None]:
        try:
            for i in range(3):
                yield sse({"i": i})
            yield DONE
        finally:
            closed.append("generator")

    app = FastAPI()

    @app.get("/stream")
    async def stream() -> SSEResponse:
        return SSEResponse(events(), on_close=lambda: closed.append("on_close"))

    async def read() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/stream")

    response = asyncio.run(read())
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.text == "".join(sse({"i": i}) for i in range(3)) + DONE
    assert closed == ["generator", "on_close"]


async def _items(name: str, count: int, delay: float) -> AsyncIterator[str]:
    for i in range(count):
        await asyncio.sleep(delay)
        yield f"{name}{i}"


def test_merged_streams_give_every_item_each_in_its_streams_order():
    async def run() -> list[tuple[int, str]]:
        streams = [_items("a", 4, 0.003), _items("b", 3, 0.005), _items("c", 0, 0)]
        return [arrival async for arrival in merge_streams(streams)]

    merged = asyncio.run(run())
    assert sorted(merged) == [(0, f"a{i}") for i in range(4)] + [(1, f"b{i}") for i in range(3)]
    for index in (0, 1):
        mine = [item for i, item in merged if i == index]
        assert mine == sorted(mine)


def test_a_failing_stream_raises_and_cancels_the_others():
    cancelled: list[bool] = []

    async def endless() -> AsyncIterator[str]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield "tick"
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def failing() -> AsyncIterator[str]:
        await asyncio.sleep(0.01)
        raise RuntimeError("engine failed")
        yield "never"

    async def run() -> None:
        async for _ in merge_streams([endless(), failing()]):
            pass

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(asyncio.wait_for(run(), 5))  # a stream left running would hang it
    assert cancelled == [True]


def test_leaving_the_merge_early_cancels_every_stream():
    cancelled: list[int] = []

    async def endless(index: int) -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield index
        except asyncio.CancelledError:
            cancelled.append(index)
            raise

    async def run() -> None:
        merged = merge_streams([endless(0), endless(1)])
        async for _ in merged:
            break
        await merged.aclose()

    asyncio.run(asyncio.wait_for(run(), 5))  # a stream left running would hang it
    assert sorted(cancelled) == [0, 1]
