"""The OpenAI wire format: request bodies (validated) and response bodies (constructed).

Request models are strict (`"n": true` or `"max_tokens": "5"` is a 400, not a guess) and
closed: no field is silently dropped. A field a model declares is honoured; any other is
a 400 naming it, except the `NO_OP_FIELDS`, which cannot change the output and are
accepted and ignored. `UNSUPPORTED_FIELDS` says why a known field is refused; one sent as
null asks for nothing and is accepted. `None` in a sampling field (left out, or null)
means "the default": the server's (`engine.sampling.params`), else SamplingParams'.
Ranges are checked once, by `SamplingParams`, not here.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    PlainValidator,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from engine.request.intake import Prompt, as_prompt_list
from engine.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    SEED_RANGE,
    SamplingParams,
    StructuredOutputs,
    with_defaults,
)
from server.config import KeepAlive

# Request fields that carry over to SamplingParams under the same name.
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "priority",
)


# Accepted and ignored, in any request model: they cannot change what the server returns.
NO_OP_FIELDS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags for completions the provider stores",
    "store": "asks the provider to store the completion",
    "service_tier": "the provider's processing tier",
    "prompt_cache_key": "a hint for the provider's prompt cache (prefix caching is automatic)",
    "include_obfuscation": "stream_options: pads stream events against side channels",
}

# Fields OpenAI or vLLM define that would change the output and that this server does not
# implement: a 400 "not supported" with the reason, wherever they appear undeclared.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "suffix": "insertion (text after the completion) is not implemented",
    "best_of": "ranking several samples to return the best is not implemented; use n",
    "echo": "echoing the last chat message is not implemented",
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "modalities": "this server returns text only",
    "audio": "this server takes and returns text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "reasoning controls are not implemented",
    "verbosity": "verbosity controls are not implemented",
    "web_search_options": "web search is not implemented",
    "functions": "the deprecated function-calling fields are not implemented",
    "function_call": "the deprecated function-calling fields are not implemented",
    "allowed_token_ids": "token allow-lists are not implemented (logit_bias can ban tokens)",
    "bad_words": "bad-word lists are not implemented (logit_bias can ban tokens)",
    "logits_processors": "custom logits processors are not implemented",
    "truncate_prompt_tokens": "prompt truncation is not implemented; a long prompt is a 400",
    "add_special_tokens": "prompts are always tokenized the one way, as /tokenize shows",
    "chat_template": "the model's own chat template is always used",
    "add_generation_prompt": "the assistant's turn is always opened",
    "continue_final_message": "the assistant's turn is always opened",
    "skip_special_tokens": "detokenization settings are not exposed",
    "spaces_between_special_tokens": "detokenization settings are not exposed",
    "include_stop_str_in_output": "detokenization settings are not exposed",
    "return_tokens_as_token_ids": "logprobs always name tokens by their text",
    "continuous_usage_stats": "usage is reported once, in the last chunk",
}

# Arguments of transformers' `apply_chat_template` that the server sets itself: not
# variables a request may give the template in `chat_template_kwargs` (vLLM refuses
# `chat_template` and `tokenize` there).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
    "tools", "documents", "conversation", "messages", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip

# The pydantic error type of `field_error`; `server.errors` names its field as `param`.
FIELD_ERROR = "field_error"


def field_error(field: str | tuple[str | int, ...], reason: str) -> PydanticCustomError:
    """An error about `field` (a path below the model that raises it; () for the model
    itself) for a model validator to raise; `reason` follows the field's name."""
    path = (field,) if isinstance(field, str) else field
    return PydanticCustomError(FIELD_ERROR, "{reason}", {"field": path, "reason": reason})


def check_type(
    data: Any, allowed: Collection[str], message: str, default: str | None = None
) -> Any:
    """A model validator's gate on a part's `type`: `data` unchanged when its type is one
    of `allowed` (or absent, or no string: the model's own validation reports that), else
    a 400 naming `type` with `message`, in which `{kind}` is the refused type's repr."""
    kind = data.get("type") if isinstance(data, dict) else None
    if isinstance(kind, str) and kind not in allowed:
        raise field_error("type", message.format(kind=repr(kind)))
    return data


def undeclared_field_reason(name: str, refused: Mapping[str, str] = UNSUPPORTED_FIELDS) -> str:
    """Why an undeclared field `name` was refused, for the 400 that names it; `refused`:
    the API's fields it knows and does not implement, with the reasons."""
    if name in refused:
        return f"not supported: {refused[name]}"
    return "unrecognized request argument: this server does not know it, so it cannot honour it"


class _Request(BaseModel):
    """A request model: strict and closed (see the module docstring). Pydantic refuses
    undeclared fields (`extra_forbidden`) after `_drop_ignorable` removed those that
    may be ignored, so a field a model declares is always validated and honoured."""

    model_config = ConfigDict(strict=True, extra="forbid")
    # The undeclared fields accepted and ignored, and those refused with a reason (another
    # API's models name their own, server/anthropic/protocol.py).
    IGNORED_FIELDS: ClassVar[Mapping[str, str]] = NO_OP_FIELDS
    REFUSED_FIELDS: ClassVar[Mapping[str, str]] = UNSUPPORTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _drop_ignorable(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        declared = {info.alias or name for name, info in cls.model_fields.items()}
        return {
            key: value
            for key, value in data.items()
            if key in declared
            or not (key in cls.IGNORED_FIELDS or (key in cls.REFUSED_FIELDS and value is None))
        }


class _Body(_Request):
    """A whole request body. Also refuses a lone surrogate (`"\\ud800"`) in any of its
    strings, keys included: JSON can escape one, but it is not Unicode text, so neither
    the tokenizer nor a response (an error included) could carry it."""

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The body's schema, with the fields it accepts and ignores among its properties
        (any value; their description says why they change nothing)."""
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).setdefault("properties", {})
        for name, reason in cls.IGNORED_FIELDS.items():
            properties.setdefault(name, {"description": f"accepted and ignored: {reason}"})
        return schema

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        path = _lone_surrogate_path(data)
        if path is not None:
            raise field_error(path, "contains a lone surrogate, which is not valid Unicode")
        return data


# The bases of another API's request models: strict and closed as these are.
RequestModel = _Request
RequestBody = _Body


def _lone_surrogate_path(data: Any) -> tuple[str | int, ...] | None:
    """The path to the first string in `data` that UTF-8 cannot encode (for a key: the
    path to its object), or None if there is none. Iterative: JSON may nest deeply."""
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return path
        if isinstance(value, dict):
            if not all(_is_unicode(key) for key in value if isinstance(key, str)):
                return path
            pending.extend(((*path, key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: the schema and OpenAI's name for it."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` object: exactly one constraint (checked by the engine)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# The request fields that ask for structured outputs; at most one may be given.
STRUCTURED_OUTPUT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def limits(**bounds: float) -> Any:
    """An optional field whose JSON Schema states the bounds `SamplingParams` enforces
    (`minimum`, `maximum`, `exclusiveMinimum`); the check and its message stay the
    engine's own."""
    return Field(default=None, json_schema_extra=bounds)


# The prompt of /v1/completions as `as_prompt_list` takes it.
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            "minItems": 1,
        },
    ]
}


class SamplingRequest(_Body):
    """The fields completions and chat share; all map onto `SamplingParams`."""

    # max_tokens when neither the request nor the server's defaults set it; None: the room
    # left in the context.
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None
    model: str
    # Ollama's: how long the model stays loaded after this request (server/model_pool.py).
    keep_alive: KeepAlive | None = None
    n: int | None = limits(minimum=1, maximum=MAX_N)
    temperature: float | None = limits(minimum=0)
    top_p: float | None = limits(exclusiveMinimum=0, maximum=1)
    stop: str | list[str] | None = None
    seed: int | None = limits(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    presence_penalty: float | None = limits(minimum=-2, maximum=2)
    frequency_penalty: float | None = limits(minimum=-2, maximum=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(  # token id (as a string) -> bias
        None,
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        },
    )
    # Extensions beyond OpenAI's API, as vLLM offers them.
    top_k: int | None = limits(minimum=-1)
    min_p: float | None = limits(minimum=0, maximum=1)
    repetition_penalty: float | None = limits(exclusiveMinimum=0)
    min_tokens: int | None = limits(minimum=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # A lower value is served first under the priority scheduling policy (vLLM's); the fcfs
    # policy refuses any but 0 (engine/request/intake.py).
    priority: int | None = None
    # vLLM's: the logprobs of the prompt's tokens, with this many alternatives each.
    prompt_logprobs: int | None = limits(minimum=0, maximum=MAX_LOGPROBS)
    # Structured outputs (see `structured_outputs_field`): OpenAI's and vLLM's spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _one_structured_output(self) -> SamplingRequest:
        given = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise field_error(given[1], f"only one of {', '.join(given)} may be given")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise field_error("response_format", "type json_schema needs json_schema")
        return self

    @property
    def structured_outputs_field(self) -> str | None:
        """The request field that asks for structured outputs, if one does."""
        return next((n for n in STRUCTURED_OUTPUT_FIELDS if getattr(self, n) is not None), None)

    def error_aliases(self) -> dict[str, str]:
        """Engine setting -> the request field that gave it, where the names differ: errors
        about structured outputs name the field the client used (see `user_errors`)."""
        field = self.structured_outputs_field
        return {"structured_outputs": field} if field not in (None, "structured_outputs") else {}

    def structured_outputs_spec(self) -> StructuredOutputs | None:
        """The constraint the request asks for, in the engine's terms; None for plain text.
        Raises ValueError (starting "structured_outputs") when it is not exactly one."""
        if self.response_format is not None:
            fmt = self.response_format
            if fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputs(json_object=True)
            assert fmt.json_schema is not None
            return StructuredOutputs(json=fmt.json_schema.schema_)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputs(
                json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                choice=so.choice, grammar=so.grammar,
            )  # fmt: skip
        if self.guided_json is not None:
            return StructuredOutputs(json=self.guided_json)
        if self.guided_regex is not None:
            return StructuredOutputs(regex=self.guided_regex)
        if self.guided_choice is not None:
            return StructuredOutputs(choice=self.guided_choice)
        if self.guided_grammar is not None:
            return StructuredOutputs(grammar=self.guided_grammar)
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise field_error("prompt_logprobs", "is not supported when streaming")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any],
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request as `SamplingParams`: its own values (`max_tokens`: its limit, None if
        it set none; `prompt_logprobs`: the engine's, which echo may raise) win; a field it
        left out or sent as null takes the server's default
        from `defaults` (see `engine.sampling.params`), else SamplingParams' own, and
        `max_tokens` else `DEFAULT_MAX_TOKENS`. Raises ValueError naming the parameter
        when a value is out of range."""
        requested = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        requested["max_tokens"] = max_tokens
        values = with_defaults(requested, {"max_tokens": self.DEFAULT_MAX_TOKENS, **defaults})
        if self.logit_bias is not None:
            values["logit_bias"] = _token_id_keys(self.logit_bias)
        structured = self.structured_outputs_spec()
        if structured is not None:
            values["structured_outputs"] = structured
        return SamplingParams(logprobs=logprobs, prompt_logprobs=prompt_logprobs, **values)


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


def _token_id_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys (token ids as decimal strings) as ints; ValueError if not."""
    for key in logit_bias:
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids such as '50256', got {key!r}")
    return {int(key): bias for key, bias in logit_bias.items()}


class TextPart(_Request):
    """A content part; only text ones are supported (this server serves text models)."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return check_type(data, ("text",), "{kind} content parts are not supported: text only")


class FunctionCall(_Request):
    """A call an assistant made: `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ChatMessage's invariants on its fields, in its JSON Schema.
_MESSAGE_RULES = {
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "assistant"}}},
            "else": {
                "required": ["content"],
                "properties": {
                    "content": {"not": {"type": "null"}},
                    "tool_calls": {"type": "null"},
                },
            },
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {
                "required": ["tool_call_id"],
                "properties": {"tool_call_id": {"type": "string"}},
            },
        },
    ]
}


class ChatMessage(_Request):
    """Invariants: only an assistant message may come without content; `tool_calls` come
    only on assistant messages, and each call's arguments are a JSON object; a tool
    message carries the `tool_call_id` it answers. The schema states all but the
    arguments'."""

    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"required in a {self.role} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise field_error("tool_calls", "only an assistant message makes tool calls")
        for i, call in enumerate(self.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                path = ("tool_calls", i, "function", "arguments")
                raise field_error(path, "must be a JSON object, as text")
        if self.role == "tool" and self.tool_call_id is None:
            raise field_error("tool_call_id", "required in a tool message")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """Invariants: `tool_choice` and `parallel_tool_calls` come only with `tools`; tool
    names are distinct and a named choice names one of them."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = limits(minimum=1)
    max_completion_tokens: int | None = limits(minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = limits(minimum=0, maximum=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template (Qwen3's `enable_thinking: false` turns
    # its thinking off); one the template does not read changes nothing, as in vLLM.
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_kwargs_are_variables(self) -> ChatCompletionRequest:
        _check_template_kwargs(self.chat_template_kwargs)
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "function names must be distinct")
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, field) is not None and not self.tools:
                raise field_error(field, "only allowed when tools are given")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error("tool_choice", f"names {choice.function.name!r}, not a tool")
        structured = self.structured_outputs_field
        if self.forces_tool_call and structured is not None:
            raise field_error(structured, "cannot be combined with a tool_choice forcing a call")
        return self

    @property
    def forces_tool_call(self) -> bool:
        """Whether the reply must be tool calls: `required`, or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in sorted(RESERVED_TEMPLATE_KWARGS & (kwargs or {}).keys()):
        raise field_error(("chat_template_kwargs", key), "not supported: the server sets it")


class TokenizeRequest(_Body):
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
        _check_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The base of the other endpoints' response models.
ResponseModel = _Response


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Response):
    """OpenAI's legacy per-token format, one entry per generated token in each list."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    """vLLM's entry for one token at one prompt position: `rank` is 1-based."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token (the first None), token id (a string) -> entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(_Response):
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


class DeltaToolCall(_Response):
    """A streamed call: sent whole, in one delta, once its text is complete."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends the role first, then `{"content": ...}`, and `{}` at the end.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
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


class LoadLoRARequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's); `model`: the base model, default the first."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = None


class UnloadLoRARequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_path: str | None = None


class ModelAction(_Body):
    """POST /models/load and /models/unload: the model's name, as requests give it."""

    model: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only when asked for: left out otherwise


class DetokenizeResponse(_Response):
    prompt: str
