"""POST /v1/completions: one or many prompts, n samples each, as JSON or a stream.

`echo` with `logprobs` covers the prompt's tokens too (first), from the engine's prompt
logprobs; with `max_tokens: 0` (not streaming) the choice is the prompt alone.

Everything a user can get wrong (parameters, model name, prompt length) is checked
before the engine sees the request (prompts on the engine's intake thread), so a stream
never starts for a request that would fail validation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fastapi import Request, Response

from engine.errors import EngineError
from server.auth import keyed_router
from server.errors import OpenAIError, engine_failure, error_body, user_errors
from server.generation import (
    Handling,
    count_usage,
    final_outputs,
    generate,
    json_response,
    new_request_id,
    rendered_prompt,
)
from server.openai.logprobs import CompletionLogprobsFormatter, joined, prompt_logprobs
from server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.openapi import ADMITTED, INVALID, MODEL, documented
from server.protocol import Usage
from server.streaming import DONE, sse

if TYPE_CHECKING:
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.request.intake import EngineRequest
    from engine.sampling.params import SamplingParams

router = keyed_router()
_FIELDS = set(CompletionRequest.model_fields)


_STREAM = "server-sent events (stream true): each data line a text_completion chunk, then [DONE]"


@router.post(
    "/v1/completions",
    response_model=None,
    responses=documented(CompletionResponse, *INVALID, *MODEL, *ADMITTED, stream=_STREAM),
)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    handling = await Handling.begin(request, body.model, body.keep_alive)
    llm = handling.llm
    with user_errors(_FIELDS, aliases=body.error_aliases()):
        params = body.sampling_params(
            max_tokens=1 if body.echo_only else body.max_tokens,
            logprobs=body.logprobs,
            defaults=llm.default_sampling,
            prompt_logprobs=body.engine_prompt_logprobs,
        )
        rendered = rendered_prompt(request) if len(body.prompt) == 1 else None
        if rendered is not None:
            prompts = [await llm.process_rendered(rendered, params)]
        else:
            prompts = [await llm.process(prompt, params) for prompt in body.prompt]
    if body.echo:
        prefixes = [p if isinstance(p, str) else await llm.decode(p) for p in body.prompt]
    else:
        prefixes = [""] * len(prompts)
    first_tokens = []
    if body.echo and body.logprobs is not None:
        first_tokens = [await llm.decode(prompt.prompt_token_ids[:1]) for prompt in prompts]
    completion = _Completion(handling, body, params, prompts, prefixes, first_tokens)
    samples = len(prompts) * params.n
    if body.stream:
        return handling.stream(samples, completion.events)
    return json_response(completion.response(await handling.run(samples, completion.run)))


@dataclass(slots=True)
class _Completion:
    """One validated completion request. `prefixes[p]` starts every choice of prompt p:
    the prompt's text when echoing, else empty. `deadline` ends it early (a 504).
    `first_tokens[p]`, with echo and logprobs, is the text of prompt p's first token."""

    handling: Handling
    body: CompletionRequest
    params: SamplingParams
    prompts: list[EngineRequest]
    prefixes: list[str]
    first_tokens: list[str]
    request_id: str = field(default_factory=lambda: new_request_id("cmpl"))
    created: int = field(default_factory=lambda: int(time.time()))

    async def run(self) -> list[RequestOutput]:
        return await final_outputs(self.handling, self.prompts, self.request_id)

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        if self.body.echo_only:
            finals = [_without_generation(output) for output in finals]
        count = self.body.prompt_logprobs
        choices = []
        for prompt_index, output in enumerate(finals):
            prefix = self.prefixes[prompt_index]
            for completion in output.outputs:
                choices.append(
                    CompletionChoice(
                        index=prompt_index * self.params.n + completion.index,
                        text=prefix + completion.text,
                        logprobs=self._choice_logprobs(prompt_index, output, completion),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=None
                        if count is None
                        else prompt_logprobs(output.prompt_logprobs or [], count),
                    )
                )
        return self._envelope(choices, count_usage(finals))

    def _choice_logprobs(
        self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> CompletionLogprobs | None:
        """The choice's legacy logprobs: with echo the prompt's tokens, then its own."""
        count = self.body.logprobs
        if count is None:
            return None
        offset = len(self.prefixes[prompt_index])
        generated = CompletionLogprobsFormatter(offset).format(completion.logprobs or [])
        if not self.body.echo:
            return generated
        assert output.prompt_logprobs is not None, "echo with logprobs asks for them"
        echoed = CompletionLogprobsFormatter(0).format_prompt(
            self.first_tokens[prompt_index], output.prompt_logprobs, count
        )
        return joined(echoed, generated)

    async def events(self, http_id: str) -> AsyncGenerator[str, None]:
        """The SSE stream: echoes first, then text deltas; each choice's last chunk has its
        finish_reason; then the usage chunk if asked for, then [DONE]."""
        n = self.params.n
        formatters = {}
        for prompt_index, prefix in enumerate(self.prefixes):
            for sample in range(n):
                index = prompt_index * n + sample
                formatters[index] = self._formatter(len(prefix))
                if prefix:
                    yield sse(self._envelope([CompletionChoice(index=index, text=prefix)]))
        wholes: dict[int, RequestOutput] = {}
        finished: set[int] = set()
        try:
            async for prompt_index, output, whole in generate(
                self.handling, self.prompts, self.request_id
            ):
                wholes[prompt_index] = whole
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    if index in finished:
                        continue
                    if completion.finish_reason is not None:
                        finished.add(index)
                    choice = _delta_choice(index, completion, formatters[index])
                    if choice is not None:
                        yield sse(self._envelope([choice]))
        except EngineError as exc:
            yield sse(error_body(engine_failure(http_id, exc)))
            yield DONE
            return
        except OpenAIError as exc:  # the deadline passed: what was sent stays sent
            yield sse(error_body(exc))
            yield DONE
            return
        if self.body.include_usage:
            in_order = [wholes[i] for i in range(len(self.prompts))]
            yield sse(self._envelope([], count_usage(in_order)))
        yield DONE

    def _formatter(self, offset: int) -> CompletionLogprobsFormatter | None:
        if self.body.logprobs is None:
            return None
        return CompletionLogprobsFormatter(offset)

    def _envelope(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.handling.model_name,
            choices=choices,
            usage=usage,
        )


def _without_generation(output: RequestOutput) -> RequestOutput:
    """`output` with its samples' one computed token left out (`echo_only`): no text,
    tokens or logprobs, finished for length (0 tokens asked for)."""
    outputs = [
        replace(c, text="", token_ids=[], logprobs=[], finish_reason="length", stop_reason=None)
        for c in output.outputs
    ]
    return replace(output, outputs=outputs)


def _delta_choice(
    index: int, completion: CompletionOutput, formatter: CompletionLogprobsFormatter | None
) -> CompletionChoice | None:
    """The chunk for what `completion` gained since the last output, or None if nothing."""
    logprobs = None
    if formatter is not None and completion.logprobs:
        logprobs = formatter.format(completion.logprobs)
    if not completion.text and logprobs is None and completion.finish_reason is None:
        return None
    return CompletionChoice(
        index=index,
        text=completion.text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )
