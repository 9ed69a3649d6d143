"""The wire format every API shares: the bases of request bodies (validated) and response
bodies (constructed), the field errors, and the sampling request that chat completions,
completions, the Responses API and Anthropic's messages all become.

Request models are strict (`"n": true` or `"max_tokens": "5"` is a 400, not a guess) and
closed: no field is silently dropped. A field a model declares is honoured; any other is
a 400 naming it, except the `NO_OP_FIELDS`, which cannot change the output and are
accepted and ignored. `UNSUPPORTED_FIELDS` says why a known field is refused; one sent as
null asks for nothing and is accepted. `None` in a sampling field (left out, or null)
means "the default": the server's (`engine.sampling.params`), else SamplingParams'.
Ranges are checked once, by `SamplingParams`, not here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

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


class RequestModel(BaseModel):
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


class RequestBody(RequestModel):
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


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the schema and OpenAI's name for it."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
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


class SamplingRequest(RequestBody):
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


def _token_id_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys (token ids as decimal strings) as ints; ValueError if not."""
    for key in logit_bias:
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids such as '50256', got {key!r}")
    return {int(key): bias for key, bias in logit_bias.items()}


class ResponseModel(BaseModel):
    """A response model: constructed by the server, so closed (a misspelt field fails
    at once rather than leaving the wire)."""

    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
