"""Running the prompts of one API request on the engine, and counting what they used.

One API request with several prompts becomes one engine request per prompt, with ids
`<request id>-<prompt index>`; a request's choice `prompt_index * n + sample_index`.
The engine's outputs are deltas: streams send them on as they come, and a whole response
accumulates them (`RequestOutput.add`). The prompts' streams are interleaved as their
outputs arrive (`merge_streams`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from server.admission import Deadline
from server.errors import deadline_exceeded
from server.protocol import PromptTokensDetails, Usage
from server.state import ServerState

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.outputs import RequestOutput
    from engine.request.intake import EngineRequest


T = TypeVar("T")


def new_request_id(prefix: str) -> str:
    """A fresh id: engine ids must be unique among live requests, whatever clients send."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def generate(
    state: ServerState,
    llm: AsyncLLM,
    requests: Sequence[EngineRequest],
    request_id: str,
    deadline: Deadline | None = None,
) -> AsyncGenerator[tuple[int, RequestOutput, RequestOutput], None]:
    """Yield `(prompt index, output, whole)` as any prompt progresses: `output` holds the
    deltas, `whole` that prompt's output so far. Records each prompt's TTFT at its first
    token, finished requests' other latencies, and their sequences for the drain rate.

    Closing this generator aborts every prompt's engine request that has not finished. So
    does `deadline` passing while it waits for the engine; it then raises the 504 of
    `deadline_exceeded` (the time a consumer spends between items counts, but the check
    is made when it asks for the next one).
    """
    streams = [llm.generate(request, f"{request_id}-{i}") for i, request in enumerate(requests)]
    wholes: dict[int, RequestOutput] = {}
    first_tokens: set[int] = set()  # the prompts whose TTFT is recorded
    async with aclosing(merge_streams(streams)) as merged:
        while True:
            try:
                index, output = await _next_before(merged, deadline)
            except StopAsyncIteration:
                return
            except TimeoutError:
                assert deadline is not None
                state.metrics.requests_timed_out.inc()
                generated = sum(len(c.token_ids) for w in wholes.values() for c in w.outputs)
                raise deadline_exceeded(deadline.timeout, generated) from None
            whole = wholes.get(index)
            if whole is None:
                whole = wholes[index] = output.copy()
            else:
                whole.add(output)
            if index not in first_tokens and whole.metrics.first_token_time is not None:
                first_tokens.add(index)
                state.metrics.observe_first_token(whole)
            if output.finished:
                state.metrics.observe_finished(whole)
                state.admission.record_finished(len(whole.outputs))
            yield index, output, whole


async def _next_before(items: AsyncIterator[T], deadline: Deadline | None) -> T:
    """The next item, or TimeoutError once `deadline` has passed. On a timeout while
    waiting, the cancellation reaches `items`, which ends (a `merge_streams` aborts)."""
    if deadline is None:
        return await anext(items)
    remaining = deadline.remaining()
    if remaining <= 0:
        raise TimeoutError
    async with asyncio.timeout(remaining):
        return await anext(items)


async def final_outputs(
    state: ServerState,
    llm: AsyncLLM,
    requests: Sequence[EngineRequest],
    request_id: str,
    deadline: Deadline | None = None,
) -> list[RequestOutput]:
    """Each prompt's whole (finished) output, in prompt order."""
    wholes: dict[int, RequestOutput] = {}
    async for index, _, whole in generate(state, llm, requests, request_id, deadline):
        wholes[index] = whole
    return [wholes[i] for i in range(len(requests))]


def count_usage(outputs: Sequence[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    cached_tokens = sum(output.num_cached_tokens for output in outputs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


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
