"""POST /v1/chat/completions: messages through the model's chat template, n samples.

The conversation is rendered and tokenized by the tokenizer's own chat template with the
assistant's turn opened (on the engine's intake thread, see `AsyncLLM.process_chat`), so
the model sees exactly the format it was trained on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request, Response

from engine.errors import EngineError
from server.auth import keyed_router
from server.chat_protocol import ChatCompletionRequest, ResponseToolCall
from server.conversation import CallStream, OfferedTools, ToolRequest, render
from server.errors import OpenAIError, engine_failure, error_body, invalid_request, user_errors
from server.generation import (
    Handling,
    count_usage,
    final_outputs,
    generate,
    json_response,
    new_request_id,
)
from server.openai.logprobs import chat_logprobs, prompt_logprobs
from server.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaToolCall,
)
from server.openapi import ADMITTED, INVALID, MODEL, documented
from server.protocol import Usage
from server.reasoning import ReasoningStream, ReasoningSyntax, split_reasoning
from server.streaming import DONE, sse

if TYPE_CHECKING:
    from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
    from engine.request.intake import EngineRequest

router = keyed_router()
_FIELDS = set(ChatCompletionRequest.model_fields)


_STREAM = "server-sent events (stream true): each data line a ChatCompletionChunk, then [DONE]"


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=documented(ChatCompletionResponse, *INVALID, *MODEL, *ADMITTED, stream=_STREAM),
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    handling = await Handling.begin(request, body.model, body.keep_alive)
    llm = handling.llm
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("top_logprobs needs logprobs set to true", "top_logprobs")
    # max_completion_tokens is OpenAI's newer name for max_tokens and wins when both are set.
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    aliases = {"logprobs": "top_logprobs", **body.error_aliases()}
    if body.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    handling.check_tool_count(len(body.tools or ()))
    reasoning = handling.reasoning_syntax()
    with user_errors(_FIELDS, aliases=aliases):
        params = body.sampling_params(
            max_tokens=max_tokens,
            logprobs=logprobs,
            defaults=llm.default_sampling,
            prompt_logprobs=body.prompt_logprobs,
        )
        tools = ToolRequest.of(body)
        conversation = render(
            body.messages, tools, body.chat_template_kwargs, handling.model.tool_calling
        )
        prompt = await handling.chat_prompt(params, conversation, reasoning, aliases)
    chat = _Chat(handling, body, prompt, conversation.tools, reasoning)
    if body.stream:
        return handling.stream(prompt.params.n, chat.events)
    return json_response(chat.response(await handling.run(prompt.params.n, chat.run)))


@dataclass(slots=True)
class _Chat:
    """One validated chat request over one rendered prompt; `deadline` ends it early.
    `reasoning`: how the model reasons (None: all of its text is the answer); tool calls
    are read from the answer only."""

    handling: Handling
    body: ChatCompletionRequest
    prompt: EngineRequest
    tools: OfferedTools | None
    reasoning: ReasoningSyntax | None
    request_id: str = field(default_factory=lambda: new_request_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))

    async def run(self) -> RequestOutput:
        finals = await final_outputs(self.handling, [self.prompt], self.request_id)
        return finals[0]

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in final.outputs:
            reasoning, answer = split_reasoning(
                self.reasoning, self.prompt.prompt_token_ids, completion.text
            )
            content: str | None = answer
            calls: list[ResponseToolCall] = []
            if self.tools is not None:
                content, calls = self.tools.response_calls(answer)
            message = ChatResponseMessage(
                content=content, reasoning_content=reasoning, tool_calls=calls or None
            )
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(completion.logprobs),
                    finish_reason=_finish_reason(completion.finish_reason, calls),
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.handling.model_name,
            choices=choices,
            usage=count_usage([final]),
            prompt_logprobs=None
            if self.body.prompt_logprobs is None
            else prompt_logprobs(final.prompt_logprobs or [], self.body.prompt_logprobs),
        )

    async def events(self, http_id: str) -> AsyncGenerator[str, None]:
        """The SSE stream: each choice's role, then reasoning and content deltas, then per
        choice a chunk with an empty delta and the finish_reason; the usage chunk if asked
        for; [DONE]."""
        for index in range(self.prompt.params.n):
            delta = ChatDelta(role="assistant", content="")
            yield sse(self._chunk(ChatStreamChoice(index=index, delta=delta)))
        whole: RequestOutput | None = None
        finished: set[int] = set()
        streams = self._tool_streams()
        thoughts = self._reasoning_streams()
        try:
            async for _, output, latest in generate(self.handling, [self.prompt], self.request_id):
                whole = latest
                for completion in output.outputs:
                    if completion.index in finished:
                        continue
                    stream = streams.get(completion.index)
                    thought = thoughts.get(completion.index)
                    reasoning, answer = _split(thought, completion.text)
                    text = answer if stream is None else stream.feed(answer)
                    logprobs = self._logprobs(completion.logprobs)
                    if text or reasoning or (logprobs and logprobs.content):
                        delta = _text_delta(reasoning, text)
                        choice = ChatStreamChoice(
                            index=completion.index, delta=delta, logprobs=logprobs
                        )
                        yield sse(self._chunk(choice))
                    if completion.finish_reason is None:
                        continue
                    finished.add(completion.index)
                    for event in self._choice_end(completion, stream, thought):
                        yield event
        except EngineError as exc:
            yield sse(error_body(engine_failure(http_id, exc)))
            yield DONE
            return
        except OpenAIError as exc:  # the deadline passed: what was sent stays sent
            yield sse(error_body(exc))
            yield DONE
            return
        if self.body.include_usage:
            assert whole is not None, "the engine's last output is always a finished one"
            yield sse(self._chunk(None, count_usage([whole])))
        yield DONE

    def _choice_end(
        self,
        completion: CompletionOutput,
        stream: CallStream | None,
        thought: ReasoningStream | None,
    ) -> Iterator[str]:
        """The events that end a choice: the reasoning and text held back, its calls, and
        an empty delta with the finish_reason."""
        reasoning, rest = ("", "") if thought is None else thought.finish()
        calls: list[ResponseToolCall] = []
        if stream is not None:
            rest = stream.feed(rest)
            more, calls = stream.finish()
            rest += more
        if reasoning or rest:
            delta = _text_delta(reasoning, rest)
            yield sse(self._chunk(ChatStreamChoice(index=completion.index, delta=delta)))
        if calls:
            yield sse(self._chunk(self._tool_call_delta(completion.index, calls)))
        choice = ChatStreamChoice(
            index=completion.index,
            delta=ChatDelta(),
            finish_reason=_finish_reason(completion.finish_reason, calls),
            stop_reason=completion.stop_reason,
        )
        yield sse(self._chunk(choice))

    def _tool_streams(self) -> dict[int, CallStream]:
        """Per choice, the splitter of its text into content and calls (if tools are on)."""
        if self.tools is None:
            return {}
        return {index: self.tools.stream() for index in range(self.prompt.params.n)}

    def _reasoning_streams(self) -> dict[int, ReasoningStream]:
        """Per choice, the splitter of its text into reasoning and answer (if it reasons)."""
        if self.reasoning is None:
            return {}
        ids = self.prompt.prompt_token_ids
        return {index: self.reasoning.stream(ids) for index in range(self.prompt.params.n)}

    @staticmethod
    def _tool_call_delta(index: int, calls: list[ResponseToolCall]) -> ChatStreamChoice:
        deltas = [
            DeltaToolCall(index=i, id=call.id, function=call.function)
            for i, call in enumerate(calls)
        ]
        return ChatStreamChoice(index=index, delta=ChatDelta(tool_calls=deltas))

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
            model=self.handling.model_name,
            choices=[] if choice is None else [choice],
            usage=usage,
        )


def _split(thought: ReasoningStream | None, text: str) -> tuple[str, str]:
    """The reasoning and the answer that `text`, more of a choice's text, decides."""
    return ("", text) if thought is None else thought.feed(text)


def _text_delta(reasoning: str, content: str) -> ChatDelta:
    """A delta of reasoning and content, each left out when empty (content is sent, empty,
    when neither is: a delta that carries only logprobs)."""
    return ChatDelta(
        content=content if content or not reasoning else None,
        reasoning_content=reasoning or None,
    )


def _finish_reason(reason: str | None, calls: list[ResponseToolCall]) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself in calls."""
    return "tool_calls" if calls and reason == "stop" else reason
