"""Running the prompts of one API request on the engine, and counting what they used.

One API request with several prompts becomes one engine request per prompt, with ids
`<request id>-<prompt index>`; a request's choice `prompt_index * n + sample_index`.
The engine's outputs are deltas: streams send them on as they come, and a whole response
accumulates them (`RequestOutput.add`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

from server.merge import merge_streams
from server.protocol import PromptTokensDetails, Usage
from server.state import ServerState

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.outputs import RequestOutput
    from engine.request.intake import EngineRequest


def new_request_id(prefix: str) -> str:
    """A fresh id: engine ids must be unique among live requests, whatever clients send."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def generate(
    state: ServerState, llm: AsyncLLM, requests: Sequence[EngineRequest], request_id: str
) -> AsyncGenerator[tuple[int, RequestOutput, RequestOutput], None]:
    """Yield `(prompt index, output, whole)` as any prompt progresses: `output` holds the
    deltas, `whole` that prompt's output so far. Records finished requests' latencies.

    Closing this generator aborts every prompt's engine request that has not finished.
    """
    streams = [llm.generate(request, f"{request_id}-{i}") for i, request in enumerate(requests)]
    wholes: dict[int, RequestOutput] = {}
    async with aclosing(merge_streams(streams)) as merged:
        async for index, output in merged:
            whole = wholes.get(index)
            if whole is None:
                whole = wholes[index] = output.copy()
            else:
                whole.add(output)
            if output.finished:
                state.metrics.observe_finished(whole)
            yield index, output, whole


async def final_outputs(
    state: ServerState, llm: AsyncLLM, requests: Sequence[EngineRequest], request_id: str
) -> list[RequestOutput]:
    """Each prompt's whole (finished) output, in prompt order."""
    wholes: dict[int, RequestOutput] = {}
    async for index, _, whole in generate(state, llm, requests, request_id):
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
