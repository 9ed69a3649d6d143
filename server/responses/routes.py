"""POST /v1/responses (OpenAI's Responses API), and GET and DELETE of a stored response.

A thin adapter over chat's path: the request becomes the chat completion request that
asks the same (`input.as_chat_request`), rendered by the chat template and run
with chat's tool grammar and parser, on the one engine path (intake, admission, the
sample's stops, sampling). What differs is the shape of the answer: output items and
their stream events (`output.Reply`), and the state: a response is kept
(`store`, true unless false) in the SQLite store of `store.py`, made with the app, for later
requests' `previous_response_id` and for GET, as its API key's alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from engine.errors import EngineError
from server.auth import key_owner, keyed_router
from server.conversation import OfferedTools, ToolRequest, render
from server.errors import OpenAIError, engine_failure, user_errors
from server.generation import Handling, count_usage, final_outputs, generate, json_response
from server.openapi import ADMITTED, INVALID, MODEL, documented
from server.reasoning import ReasoningSyntax, reasoning_tokens, split_reasoning
from server.responses.input import as_chat_request, stored_items, thinking_variables
from server.responses.output import Event, Reply, new_item_id
from server.responses.protocol import (
    DeletedResponse,
    FunctionChoice,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from server.responses.store import response_store
from server.streaming import one_line

if TYPE_CHECKING:
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.request.intake import EngineRequest

router = keyed_router()
# The names a 400 may give as its `param`: the body's fields, and the format of its text.
_FIELDS = set(ResponsesRequest.model_fields) | {"text.format"}


_STREAM = (
    "server-sent events (stream true): response.created, the output's events, then "
    "response.completed (or .incomplete, .failed)"
)


@router.post(
    "/v1/responses",
    response_model=None,
    responses=documented(ResponseObject, *INVALID, *MODEL, *ADMITTED, stream=_STREAM),
)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    handling = await Handling.begin(request, body.model, body.keep_alive)
    llm = handling.llm
    owner = key_owner(request)
    earlier: list[InputItem] = []
    if body.previous_response_id is not None:
        stored = await response_store(request).get(owner, body.previous_response_id)
        if stored is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        earlier = stored_items(stored.conversation, stored.response["output"])
    conversation = earlier + body.input_items()
    reasoning = handling.reasoning_syntax()
    variables = thinking_variables(body, reasoning, llm.chat_template)
    chat_body = as_chat_request(body, conversation, len(earlier), variables)
    handling.check_tool_count(len(body.tools or ()))
    aliases = {
        "max_tokens": "max_output_tokens",
        "structured_outputs": "text.format",
        "messages": "input",
    }
    with user_errors(_FIELDS, aliases=aliases):
        params = chat_body.sampling_params(
            max_tokens=body.max_output_tokens, logprobs=None, defaults=llm.default_sampling
        )
        rendered = render(
            chat_body.messages,
            ToolRequest.of(chat_body),
            chat_body.chat_template_kwargs,
            handling.model.tool_calling,
        )
        prompt = await handling.chat_prompt(params, rendered, reasoning, aliases, "input")
    turn = _Turn(handling, body, prompt, rendered.tools, reasoning, owner, conversation)
    if body.stream:
        return handling.stream(1, turn.events)
    response = turn.response(await handling.run(1, turn.run))
    await turn.keep(response)
    return json_response(response)


@router.get(
    "/v1/responses/{response_id}", response_model=None, responses=documented(ResponseObject, 404)
)
async def get_response(response_id: str, request: Request) -> Response:
    stored = await response_store(request).get(key_owner(request), response_id)
    if stored is None:
        raise _not_found(response_id, None)
    return JSONResponse(stored.response)


@router.delete(
    "/v1/responses/{response_id}",
    response_model=None,
    responses=documented(DeletedResponse, 404),
)
async def delete_response(response_id: str, request: Request) -> Response:
    if not await response_store(request).delete(key_owner(request), response_id):
        raise _not_found(response_id, None)
    return json_response(DeletedResponse(id=response_id))


def _not_found(response_id: str, param: str | None) -> OpenAIError:
    """The 404 of an id that is unknown, not stored, or another key's: the three read the
    same, so nothing says whether a response of another key exists."""
    where = f"{param}: " if param else ""
    return OpenAIError(
        404,
        f"{where}no stored response has the id {response_id!r} (a response is kept only "
        "with store true, and only the API key that created it can use it)",
        param=param,
        code="response_not_found",
    )


@dataclass(slots=True)
class _Turn:
    """One validated response request over one rendered prompt; `conversation` is its
    input items, those of the responses before it included (what a stored response keeps).
    `reasoning`: how the model reasons (None: all of its text is the answer); tool calls
    are read from the answer only."""

    handling: Handling
    body: ResponsesRequest
    prompt: EngineRequest
    tools: OfferedTools | None
    reasoning: ReasoningSyntax | None
    owner: str
    conversation: list[InputItem]
    response_id: str = field(default_factory=lambda: new_item_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))

    async def run(self) -> RequestOutput:
        [final] = await final_outputs(self.handling, [self.prompt], self.response_id)
        return final

    def response(self, final: RequestOutput) -> ResponseObject:
        """The whole response, built as a stream builds it."""
        reply = self._reply()
        [completion] = final.outputs
        reply.feed(completion.text)
        reply.finish(completion)
        return self._object(reply.output.items, final)

    async def events(self, http_id: str) -> AsyncGenerator[str, None]:
        """The SSE stream in OpenAI's order: `response.created` and `.in_progress`, each
        item's events as it is built, then `response.completed` (`.incomplete` when
        `max_output_tokens` cut the reply, `.failed` when the engine or the deadline ended
        it). The response is stored before its last event is sent."""
        numbered = _Numbered()
        yield numbered.sse({"type": "response.created", "response": self._object([], None)})
        yield numbered.sse({"type": "response.in_progress", "response": self._object([], None)})
        reply = self._reply()
        output = reply.output
        whole: RequestOutput | None = None
        try:
            async for _, delta, latest in generate(self.handling, [self.prompt], self.response_id):
                whole = latest
                for completion in delta.outputs:
                    for event in _completion_events(reply, completion):
                        yield numbered.sse(event)
        except EngineError as exc:
            failed = self._failed(output.items, engine_failure(http_id, exc), "server_error")
            yield numbered.sse({"type": "response.failed", "response": failed})
            return
        except OpenAIError as exc:  # the deadline passed: what was sent stays sent
            failed = self._failed(output.items, exc, exc.code or "request_timeout")
            yield numbered.sse({"type": "response.failed", "response": failed})
            return
        assert whole is not None, "the engine's last output is always a finished one"
        response = self._object(output.items, whole)
        await self.keep(response)
        yield numbered.sse({"type": f"response.{response.status}", "response": response})

    async def keep(self, response: ResponseObject) -> None:
        """Store `response` for its key, unless the request said `store: false`."""
        if self.body.store is False:
            return
        conversation = [
            item.model_dump(mode="json", by_alias=True, exclude_none=True)
            for item in self.conversation
        ]
        await response_store(self.handling.request).put(
            self.owner, response.model_dump(mode="json"), conversation
        )

    def _reply(self) -> Reply:
        """The builder of the reply's items, splitting off its reasoning (if the model
        reasons) and its calls (if tools are on)."""
        ids = self.prompt.prompt_token_ids
        return Reply(
            None if self.reasoning is None else self.reasoning.stream(ids),
            None if self.tools is None else self.tools.stream(),
        )

    def _object(self, items: list[OutputItem], final: RequestOutput | None) -> ResponseObject:
        """The response with `items`: in progress until `final`, the finished output."""
        body, params = self.body, self.prompt.params
        status, usage, now = "in_progress", None, None
        if final is not None:
            cut = final.outputs[0].finish_reason == "length"
            usage = self._usage(final)
            status, now = ("incomplete" if cut else "completed"), time.time()
        choice = body.tool_choice
        return ResponseObject(
            id=self.response_id,
            created_at=self.created,
            completed_at=None if now is None else int(now),
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.handling.model_name,
            output=items,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=body.store is not False,
            temperature=params.temperature,
            top_p=params.top_p,
            text={"format": body.text_format.model_dump(by_alias=True, exclude_none=True)},
            tool_choice=choice.model_dump()
            if isinstance(choice, FunctionChoice)
            else choice or "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            usage=usage,
            metadata=body.metadata,
            reasoning=None
            if body.reasoning is None
            else body.reasoning.model_dump(exclude_none=True),
        )

    def _usage(self, final: RequestOutput) -> ResponseUsage:
        """`final`'s usage; its reasoning tokens counted where the model reasons."""
        usage = count_usage([final])
        thought = 0
        if self.reasoning is not None:
            [completion] = final.outputs
            ids = self.prompt.prompt_token_ids
            reasoning, answer = split_reasoning(self.reasoning, ids, completion.text)
            thought = reasoning_tokens(self.reasoning, completion.token_ids, reasoning, answer)
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=usage.prompt_tokens_details.cached_tokens
            ),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=thought),
            total_tokens=usage.total_tokens,
        )

    def _failed(self, items: list[OutputItem], error: OpenAIError, code: str) -> ResponseObject:
        failed = self._object(items, None)
        failed.status = "failed"
        failed.error = ResponseError(code=code, message=error.message)
        return failed


class _Numbered:
    """Frames a stream's events as OpenAI does (`event:` and `data:` lines), numbering
    them from 0 in the order sent."""

    def __init__(self) -> None:
        self._next = 0

    def sse(self, event: Event) -> str:
        number, self._next = self._next, self._next + 1
        data = json.dumps(_as_json({**event, "sequence_number": number}), ensure_ascii=False)
        return f"event: {event['type']}\ndata: {one_line(data)}\n\n"


def _as_json(value: Any) -> Any:
    """`value` with the pydantic models inside it dumped (an event holds items and parts)."""
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _completion_events(reply: Reply, completion: CompletionOutput) -> list[Event]:
    """The events of a completion's new text, and of its end once it finished."""
    events = list(reply.feed(completion.text))
    if completion.finish_reason is not None:
        events += reply.finish(completion)
    return events
