"""The steps every generating endpoint shares: its prologue, its generation on the engine
and its epilogue.

Chat completions, completions, Anthropic's messages and the Responses API differ in their
request and reply shapes only. Each begins with `Handling.begin` (the request's deadline;
its model, or a 404, loaded if need be and held until the response is sent; its engine,
or a 503), checks the tools' count, builds a chat-shaped prompt from its `Conversation`
(server/conversation.py) with `chat_prompt` (the grammar of tool calls or structured
outputs held to the answer after any reasoning, the prompt rendered by the chat template
or forwarded by the scale-out ingress), and ends with `stream` (server-sent events,
server/streaming.py) or `run` (the whole reply), after admission; the client's going
away aborts either.

In between, `generate` runs the prompts of one API request on the engine: one engine
request per prompt, with ids `<request id>-<prompt index>`, and a request's choice
`prompt_index * n + sample_index`. The engine's outputs are deltas: streams send them on
as they come, and a whole response accumulates them (`RequestOutput.add`). The prompts'
streams are interleaved as their outputs arrive (`merge_streams`); `count_usage` counts what
they used.

A prompt forwarded by the scale-out ingress comes in the request's ASGI scope state
(`rendered_prompt`): the ingress renders, tokenizes and hashes each prompt with the
replica's own tokenizer to route it, and the replica takes that `RenderedPrompt` instead
of doing the work again. Only code in the same process can put it there: no HTTP request
can set a scope's state.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request, Response
from pydantic import BaseModel

from engine.request.intake import ChatTemplateError, RenderedPrompt
from server.admission import Deadline, request_deadline
from server.disconnect import cancel_on_disconnect
from server.errors import deadline_exceeded, invalid_request
from server.errors import request_id as http_request_id
from server.protocol import PromptTokensDetails, Usage
from server.reasoning import ReasoningSyntax, answer_only
from server.state import ServerState, server_state
from server.streaming import SSEResponse, merge_streams, next_before

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.outputs import RequestOutput
    from engine.request.intake import EngineRequest
    from engine.sampling.params import SamplingParams
    from server.conversation import Conversation
    from server.served_model import ServedModel


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Handling:
    """One request being handled: the server's state, its model (held until the response
    is sent) and that model's ready engine, its deadline."""

    request: Request
    state: ServerState
    model: ServedModel
    llm: AsyncLLM
    deadline: Deadline | None
    # The LoRA adapter the request named as its model (None: the model itself).
    adapter: str | None = None

    @classmethod
    async def begin(cls, request: Request, model: str, keep_alive: float | None = None) -> Handling:
        """The model named `model`, loaded first if need be: a 404 for a name the server
        does not serve, a 503 while a single model first loads or once its engine died.
        `keep_alive`: the request's, which becomes the model's."""
        state = server_state(request)
        deadline = request_deadline(state.config, request)
        served, adapter = await state.models.lease(request, model, keep_alive, deadline)
        llm = served.generator(request.url.path)
        return cls(request, state, served, llm, deadline, adapter)

    @property
    def model_name(self) -> str:
        """The name responses carry: the adapter's, else the model's served name."""
        return self.adapter or self.model.name

    def reasoning_syntax(self) -> ReasoningSyntax | None:
        """How the model reasons (the `reasoning_parser` setting); None: it does not."""
        return self.model.reasoning_syntax(self.state.config.reasoning_parser)

    def check_tool_count(self, count: int) -> None:
        """A 400 naming `tools` past the server's `max_tools`."""
        limit = self.state.config.max_tools
        if count > limit:
            raise invalid_request(
                f"tools must hold at most {limit} functions (the server's max_tools "
                f"setting), got {count}",
                "tools",
            )

    async def chat_prompt(
        self,
        params: SamplingParams,
        conversation: Conversation,
        reasoning: ReasoningSyntax | None,
        aliases: dict[str, str],
        messages_param: str = "messages",
    ) -> EngineRequest:
        """The engine request of a chat-shaped prompt, under the grammar of its structured
        output or its tools' calls (unless the request constrains the reply itself: `auto`
        tools cannot come with a format), which holds the answer only, after the reasoning
        (`auto` leaves all before a call free). Raises ValueError (for `user_errors`;
        grammar errors then name `tools` through `aliases`) or a 400 naming
        `messages_param` when the chat template refuses the conversation."""
        spec = answer_only(params.structured_outputs, reasoning)
        tools = conversation.tools
        if tools is not None and spec is None:
            aliases["structured_outputs"] = "tools"  # errors of the grammar name `tools`
            spec = tools.structured_outputs()
            if tools.forced:
                spec = answer_only(spec, reasoning)
        params = dataclasses.replace(params, structured_outputs=spec)
        rendered = rendered_prompt(self.request)
        if rendered is not None:
            return await self.llm.process_rendered(rendered, params)
        try:
            return await self.llm.process_chat(
                conversation.messages, params, conversation.template_tools, conversation.variables
            )
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), messages_param) from exc

    def stream(self, samples: int, events: Callable[[str], AsyncGenerator[str, None]]) -> Response:
        """The reply as server-sent events from `events(request id)`, once admitted."""
        ticket = self.state.admission.admit(samples)
        return SSEResponse(events(http_request_id(self.request)), on_close=ticket.release)

    async def run(self, samples: int, generation: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The whole of `generation()`, once admitted; the client's leaving aborts it."""
        with self.state.admission.admit(samples):
            return await cancel_on_disconnect(self.request, generation())


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


# The scope-state key the forwarded prompt is stored under.
RENDERED_PROMPT = "pagedserve.rendered_prompt"


def rendered_prompt(request: Request) -> RenderedPrompt | None:
    """The prompt rendered ahead for `request`, if one came with it."""
    prompt = request.scope.get("state", {}).get(RENDERED_PROMPT)
    return prompt if isinstance(prompt, RenderedPrompt) else None


def new_request_id(prefix: str) -> str:
    """A fresh id: engine ids must be unique among live requests, whatever clients send."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def generate(
    handling: Handling, requests: Sequence[EngineRequest], request_id: str
) -> AsyncGenerator[tuple[int, RequestOutput, RequestOutput], None]:
    """Yield `(prompt index, output, whole)` as any prompt progresses: `output` holds the
    deltas, `whole` that prompt's output so far. Records each prompt's TTFT at its first
    token, finished requests' other latencies, and their sequences for the drain rate.

    Closing this generator aborts every prompt's engine request that has not finished. So
    does the request's deadline passing while it waits for the engine; it then raises the
    504 of `deadline_exceeded` (the time a consumer spends between items counts, but the
    check is made when it asks for the next one).
    """
    state, llm, deadline = handling.state, handling.llm, handling.deadline
    name = handling.model.name  # the metrics' model_name: an adapter's requests count there
    if handling.adapter is not None:
        requests = [dataclasses.replace(r, lora_name=handling.adapter) for r in requests]
    streams = [llm.generate(request, f"{request_id}-{i}") for i, request in enumerate(requests)]
    wholes: dict[int, RequestOutput] = {}
    first_tokens: set[int] = set()  # the prompts whose TTFT is recorded
    async with aclosing(merge_streams(streams)) as merged:
        while True:
            try:
                index, output = await next_before(merged, deadline)
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
                state.metrics.observe_first_token(name, whole)
            if output.finished:
                state.metrics.observe_finished(name, whole)
                state.admission.record_finished(len(whole.outputs))
            yield index, output, whole


async def final_outputs(
    handling: Handling, requests: Sequence[EngineRequest], request_id: str
) -> list[RequestOutput]:
    """Each prompt's whole (finished) output, in prompt order."""
    wholes: dict[int, RequestOutput] = {}
    async for index, _, whole in generate(handling, requests, request_id):
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
