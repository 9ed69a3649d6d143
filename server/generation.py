"""Running the prompts of one API request on the engine, and counting what they used.

One API request with several prompts becomes one engine request per prompt, with ids
`<request id>-<prompt index>`; a request's choice `prompt_index * n + sample_index`.
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
    from engine.sampling.params import SamplingParams


def new_request_id(prefix: str) -> str:
    """A fresh id: engine ids must be unique among live requests, whatever clients send."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def generate(
    state: ServerState,
    llm: AsyncLLM,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    request_id: str,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield `(prompt index, output)` as any prompt progresses; record finished latencies.

    Closing this generator aborts every prompt's engine request that has not finished.
    """
    streams = [llm.generate(ids, params, f"{request_id}-{i}") for i, ids in enumerate(prompts)]
    async with aclosing(merge_streams(streams)) as merged:
        async for index, output in merged:
            if output.finished:
                state.metrics.observe_finished(output)
            yield index, output


async def final_outputs(
    state: ServerState,
    llm: AsyncLLM,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    request_id: str,
) -> list[RequestOutput]:
    """Each prompt's last (finished) output, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    async for index, output in generate(state, llm, prompts, params, request_id):
        finals[index] = output
    return [finals[i] for i in range(len(prompts))]


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
