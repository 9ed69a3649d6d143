"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API.

A thin adapter over the chat path: the conversation becomes chat messages and tools
(server/anthropic/conversation.py), rendered by the same chat template on the engine's
intake thread, sampled under the same grammar of tool calls and the same admission,
deadline and stop handling (server/generation.py); the reply's text is split into
thinking (server/reasoning.py), text and tool uses, as JSON or as Anthropic's events.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response

from engine.errors import EngineError
from engine.request.intake import ChatTemplateError
from engine.sampling.params import SamplingParams, StructuredOutputs, with_defaults
from server.anthropic.conversation import conversation, reply_blocks, tool_use
from server.anthropic.errors import AnthropicErrorBody, AnthropicRoute, error_body
from server.anthropic.events import PING, ContentBlocks, event
from server.anthropic.protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    TokenCount,
    ToolUseOut,
)
from server.auth import keyed_router
from server.conversation import OfferedTools
from server.errors import OpenAIError, engine_failure, invalid_request, user_errors
from server.generation import Handling, final_outputs, generate, json_response, new_request_id
from server.openapi import ADMITTED, INVALID, MODEL, documented
from server.reasoning import ReasoningSyntax, split_reasoning

if TYPE_CHECKING:
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.request.intake import EngineRequest

router = keyed_router(AnthropicErrorBody, AnthropicRoute)
_STREAM = (
    "server-sent events (stream true): message_start, the content blocks' events, "
    "message_delta, message_stop"
)
_FIELDS = {*MessagesRequest.model_fields, "output_config.format"}


@router.post(
    "/v1/messages",
    response_model=None,
    responses=documented(
        MessageResponse, *INVALID, *MODEL, *ADMITTED, stream=_STREAM, envelope=AnthropicErrorBody
    ),
)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    handling = await Handling.begin(request, body.model, body.keep_alive)
    llm = handling.llm
    handling.check_tool_count(len(body.tools or ()))
    reasoning = handling.reasoning_syntax()
    aliases = {"stop": "stop_sequences", "structured_outputs": "output_config.format"}
    with user_errors(_FIELDS, aliases=aliases):
        params = _sampling_params(body, llm.default_sampling)
        rendered = conversation(body, handling.model.tool_calling)
        prompt = await handling.chat_prompt(params, rendered, reasoning, aliases)
    reply = _Reply(handling, body, prompt, rendered.tools, reasoning)
    if body.stream:
        return handling.stream(1, reply.events)
    return json_response(reply.response(await handling.run(1, reply.run)))


@router.post(
    "/v1/messages/count_tokens",
    response_model=None,
    responses=documented(TokenCount, *INVALID, *MODEL, envelope=AnthropicErrorBody),
)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt tokens /v1/messages would take for this conversation and tools."""
    handling = await Handling.begin(request, body.model, body.keep_alive)
    handling.check_tool_count(len(body.tools or ()))
    with user_errors(_FIELDS):
        rendered = conversation(body, handling.model.tool_calling)
    try:
        tokens = await handling.llm.render_chat(
            rendered.messages, tools=rendered.template_tools, template_kwargs=rendered.variables
        )
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from exc
    return json_response(TokenCount(input_tokens=len(tokens)))


def _sampling_params(body: MessagesRequest, defaults: dict[str, Any]) -> SamplingParams:
    """The request's sampling settings over the server's defaults (as chat's); raises
    ValueError naming the setting when a value is out of range."""
    requested = {
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "priority": body.priority,
    }
    values = with_defaults(requested, defaults)
    output = body.output_config
    if output is not None and output.format is not None:
        values["structured_outputs"] = StructuredOutputs(json=output.format.schema_)
    return SamplingParams(**values)


@dataclass(slots=True)
class _Reply:
    """One validated message request over its rendered prompt; `deadline` ends it early.
    `reasoning`: how the model reasons (None: all of its text is the answer)."""

    handling: Handling
    body: MessagesRequest
    prompt: EngineRequest
    tools: OfferedTools | None
    reasoning: ReasoningSyntax | None
    # Anthropic's shape of id (`msg_...`); fresh, as engine request ids must be.
    request_id: str = field(default_factory=lambda: new_request_id("msg").replace("-", "_"))

    async def run(self) -> RequestOutput:
        finals = await final_outputs(self.handling, [self.prompt], self.request_id)
        return finals[0]

    def response(self, final: RequestOutput) -> MessageResponse:
        [completion] = final.outputs
        ids = self.prompt.prompt_token_ids
        reasoning, answer = split_reasoning(self.reasoning, ids, completion.text)
        content = reply_blocks(reasoning, answer, self.tools, self.body.thinking_display())
        calls = any(isinstance(block, ToolUseOut) for block in content)
        stop_reason, stop_sequence = _stop(completion, calls)
        return MessageResponse(
            id=self.request_id,
            model=self.handling.model_name,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(final),
        )

    async def events(self, http_id: str) -> AsyncGenerator[str, None]:
        """The event stream (server/anthropic/events.py): thinking and text as they come
        (text that may begin a tool call is held), each tool use whole once the reply
        ends; an `error` event ends a stream that failed (what was sent stays sent)."""
        started = MessageResponse(
            id=self.request_id,
            model=self.handling.model_name,
            content=[],
            stop_reason=None,
            usage=MessageUsage(input_tokens=len(self.prompt.prompt_token_ids), output_tokens=0),
        )
        yield event({"type": "message_start", "message": started.model_dump()})
        yield event(PING)
        pieces = _Pieces(self)
        try:
            async for _, output, whole in generate(self.handling, [self.prompt], self.request_id):
                [completion] = output.outputs
                for piece in pieces.feed(completion.text):
                    yield piece
                if completion.finish_reason is None:
                    continue
                ended, calls = pieces.finish()
                for piece in ended:
                    yield piece
                stop_reason, stop_sequence = _stop(completion, calls)
                delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                usage = _usage(whole).model_dump()
                yield event({"type": "message_delta", "delta": delta, "usage": usage})
                yield event({"type": "message_stop"})
        except EngineError as exc:
            yield event(error_body(engine_failure(http_id, exc), http_id))
        except OpenAIError as exc:  # the deadline passed
            yield event(error_body(exc, http_id))


class _Pieces:
    """One streamed reply's text as content-block events: split into reasoning and
    answer, the answer into text and tool calls (held until the reply ends)."""

    def __init__(self, reply: _Reply) -> None:
        self._blocks = ContentBlocks()
        self._display = reply.body.thinking_display()
        ids = reply.prompt.prompt_token_ids
        self._thoughts = reply.reasoning.stream(ids) if reply.reasoning is not None else None
        self._calls = None if reply.tools is None else reply.tools.stream()

    def feed(self, delta: str) -> list[str]:
        reasoning, answer = ("", delta) if self._thoughts is None else self._thoughts.feed(delta)
        events = self._thinking(reasoning)
        return events + self._blocks.text(
            answer if self._calls is None else self._calls.feed(answer)
        )

    def finish(self) -> tuple[list[str], bool]:
        """The last events, and whether the reply made tool calls."""
        reasoning, answer = ("", "") if self._thoughts is None else self._thoughts.finish()
        events = self._thinking(reasoning)
        if self._calls is None:
            return [*events, *self._blocks.close()], False
        text = self._calls.feed(answer)
        rest, calls = self._calls.finish()
        events += self._blocks.text(text + rest)
        for call in calls:
            events += self._blocks.tool_use(tool_use(call.function.name, call.function.arguments))
        return [*events, *self._blocks.close()], bool(calls)

    def _thinking(self, reasoning: str) -> list[str]:
        if not reasoning or self._display == "dropped":
            return []
        return self._blocks.thinking(reasoning, shown=self._display == "shown")


def _stop(completion: CompletionOutput, calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop reason, and the stop sequence that ended the reply if one did."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return ("tool_use" if calls else "end_turn"), None


def _usage(output: RequestOutput) -> MessageUsage:
    cached = output.num_cached_tokens
    return MessageUsage(
        input_tokens=len(output.prompt_token_ids) - cached,
        output_tokens=sum(len(c.token_ids) for c in output.outputs),
        cache_read_input_tokens=cached,
    )
