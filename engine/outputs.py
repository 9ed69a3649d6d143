"""What the engine hands back per generated token and per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities for one generated token.

    `logprob` is the chosen token's; `top` holds the `SamplingParams.logprobs` most likely
    tokens as (token_id, logprob), most likely first (it may or may not contain the chosen
    token). All values come from the model's raw distribution, before penalties,
    temperature and truncation (see `engine.sampling.sampler`).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples. `text`, `token_ids` and `logprobs` are cumulative;
    the `delta_*` fields hold what was added since the previous output of the request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """`time.monotonic()` instants of a request's life; None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step; `finished` once all samples are."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # Set when the engine failed the request; its outputs then end with "error".
    error: str | None = None
