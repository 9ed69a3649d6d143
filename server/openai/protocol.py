"""The OpenAI wire format beyond the shared request bases (server/protocol.py,
server/chat_protocol.py): completions and tokenize requests, and the response bodies of
chat completions, completions, `/v1/models` and `/tokenize`.

Request models are strict and closed as server/protocol.py says."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    PlainValidator,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from engine.request.intake import Prompt, as_prompt_list
from engine.sampling.params import (
    MAX_LOGPROBS,
)
from server.chat_protocol import (
    ChatMessage,
    ResponseFunctionCall,
    ResponseToolCall,
    check_template_kwargs,
)
from server.protocol import (
    PROMPT_SCHEMA,
    UNSUPPORTED_FIELDS,
    RequestBody,
    ResponseModel,
    SamplingRequest,
    Usage,
    field_error,
    limits,
)


class CompletionRequest(SamplingRequest):
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # OpenAI's

    prompt: Annotated[list[Prompt], PlainValidator(as_prompt_list), WithJsonSchema(PROMPT_SCHEMA)]
    max_tokens: int | None = limits(minimum=0)  # 0 only with echo
    echo: bool | None = False
    logprobs: int | None = limits(minimum=0, maximum=MAX_LOGPROBS)
    best_of: int | None = limits(minimum=1)  # accepted when null or n: one sample per choice

    @model_validator(mode="after")
    def _echo_logprobs_whole(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None and self.stream:
            raise field_error("echo", "with logprobs is not supported when streaming")
        if self.max_tokens == 0 and not (self.echo and not self.stream):
            raise field_error("max_tokens", "0 is only allowed with echo, not streaming")
        return self

    @property
    def echo_only(self) -> bool:
        """Echo the prompt and generate nothing (lm-eval's loglikelihood call): the engine
        computes one token, which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The alternatives per prompt token the engine computes: `prompt_logprobs`'s, and
        with echo `logprobs`'s, whichever is more."""
        counts = [self.prompt_logprobs]
        if self.echo:
            counts.append(self.logprobs)
        given = [count for count in counts if count is not None]
        return max(given) if given else None

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of < n:
            raise field_error("best_of", f"must be >= n ({n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > n:
            reason = UNSUPPORTED_FIELDS["best_of"]
            raise field_error("best_of", f"above n ({n}) is not supported: {reason}")
        return self


class TokenizeRequest(RequestBody):
    """vLLM's POST /tokenize. Invariant: exactly one of `prompt` (tokenized as completions
    tokenize it, `add_special_tokens` aside) or `messages` (rendered as chat renders them,
    `add_generation_prompt` aside), and each option only with its own input."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as chat's
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise field_error((), "needs exactly one of prompt and messages")
        if self.prompt is None and self.add_special_tokens is not None:
            raise field_error("add_special_tokens", "applies to a prompt, not to messages")
        for field in ("add_generation_prompt", "chat_template_kwargs"):
            if self.messages is None and getattr(self, field) is not None:
                raise field_error(field, "applies to messages, not to a prompt")
        check_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(RequestBody):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy per-token format, one entry per generated token in each list."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(ResponseModel):
    """vLLM's entry for one token at one prompt position: `rank` is 1-based."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token (the first None), token id (a string) -> entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(ResponseModel):
    """`content` is None only when the message is tool calls alone; `reasoning_content`
    is the model's reasoning (server/reasoning.py), left out when it has none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class DeltaToolCall(ResponseModel):
    """A streamed call: sent whole, in one delta, once its text is complete."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends the role first, then `{"content": ...}`, and `{}` at the end.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str
    # unloaded, loading, loaded, sleeping or failed (server/model_pool.py: ModelState).
    state: str
    # A LoRA adapter's: the model it runs on (vLLM's field); None for a model.
    parent: str | None = None
    # Known once the model is loaded (None before).
    max_model_len: int | None
    # The defaults for sampling fields a request leaves out, in SamplingParams' names
    # (engine/sampling/params.py); {}: SamplingParams' neutral ones; None until loaded.
    default_sampling_params: dict[str, Any] | None


class ModelAction(RequestBody):
    """POST /models/load and /models/unload: the model's name, as requests give it."""

    model: str


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only when asked for: left out otherwise


class DetokenizeResponse(ResponseModel):
    prompt: str
