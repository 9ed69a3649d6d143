"""POST /v1/chat/completions: messages through the model's chat template, n samples.

The conversation is rendered and tokenized by the tokenizer's own chat template with the
assistant's turn opened (on the engine's intake thread, see `AsyncLLM.process_chat`), so
the model sees exactly the format it was trained on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request, Response

from engine.errors import EngineError
from engine.request.intake import ChatTemplateError
from server.auth import require_api_key
from server.disconnect import cancel_on_disconnect
from server.errors import engine_failure, error_body, invalid_request, user_errors
from server.errors import request_id as http_request_id
from server.generation import count_usage, final_outputs, generate, new_request_id
from server.logprobs import chat_logprobs
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    Usage,
)
from server.state import ServerState, server_state
from server.streaming import DONE, SSEResponse, sse

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.outputs import RequestOutput, TokenLogprobs
    from engine.request.intake import EngineRequest, Message

router = APIRouter(dependencies=[Depends(require_api_key)])
_FIELDS = set(ChatCompletionRequest.model_fields)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    llm = state.ready_llm()
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("top_logprobs needs logprobs set to true", "top_logprobs")
    # max_completion_tokens is OpenAI's newer name for max_tokens and wins when both are set.
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    with user_errors(_FIELDS, aliases={"logprobs": "top_logprobs"}):
        params = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        try:
            prompt = await llm.process_chat(conversation(body.messages), params)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), "messages") from exc
    chat = _Chat(state, llm, body, prompt)
    if body.stream:
        return SSEResponse(chat.events(http_request_id(request)))
    final = await cancel_on_disconnect(request, chat.run())
    return Response(chat.response(final).model_dump_json(), media_type="application/json")


def conversation(messages: list[ChatMessage]) -> list[Message]:
    """The messages as a chat template reads them."""
    return [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in messages
    ]


@dataclass(slots=True)
class _Chat:
    """One validated chat request over one rendered prompt."""

    state: ServerState
    llm: AsyncLLM
    body: ChatCompletionRequest
    prompt: EngineRequest
    request_id: str = field(default_factory=lambda: new_request_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))

    async def run(self) -> RequestOutput:
        finals = await final_outputs(self.state, self.llm, [self.prompt], self.request_id)
        return finals[0]

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=self._logprobs(completion.logprobs),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in final.outputs
        ]
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=count_usage([final]),
        )

    async def events(self, http_id: str) -> AsyncGenerator[str, None]:
        """The SSE stream: each choice's role, then content deltas, then per choice a chunk
        with an empty delta and the finish_reason; the usage chunk if asked for; [DONE]."""
        for index in range(self.prompt.params.n):
            delta = ChatDelta(role="assistant", content="")
            yield sse(self._chunk(ChatStreamChoice(index=index, delta=delta)))
        whole: RequestOutput | None = None
        finished: set[int] = set()
        try:
            async for _, output, latest in generate(
                self.state, self.llm, [self.prompt], self.request_id
            ):
                whole = latest
                for completion in output.outputs:
                    if completion.index in finished:
                        continue
                    logprobs = self._logprobs(completion.logprobs)
                    if completion.text or (logprobs and logprobs.content):
                        delta = ChatDelta(content=completion.text)
                        choice = ChatStreamChoice(
                            index=completion.index, delta=delta, logprobs=logprobs
                        )
                        yield sse(self._chunk(choice))
                    if completion.finish_reason is not None:
                        finished.add(completion.index)
                        choice = ChatStreamChoice(
                            index=completion.index,
                            delta=ChatDelta(),
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                        yield sse(self._chunk(choice))
        except EngineError as exc:
            yield sse(error_body(engine_failure(http_id, exc)))
            yield DONE
            return
        if self.body.include_usage:
            assert whole is not None, "the engine's last output is always a finished one"
            yield sse(self._chunk(None, count_usage([whole])))
        yield DONE

    def _logprobs(self, entries: Sequence[TokenLogprobs] | None) -> ChatLogprobs | None:
        if self.prompt.params.logprobs is None:
            return None
        return chat_logprobs(entries or [])

    def _chunk(
        self, choice: ChatStreamChoice | None, usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.state.model_name,
            choices=[] if choice is None else [choice],
            usage=usage,
        )
