"""What the engine hands back per generated token and per request."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities for one generated token.

    `logprob` is the chosen token's; `top` holds the `SamplingParams.logprobs` most likely
    tokens as (token_id, logprob), most likely first (it may or may not contain the chosen
    token). All values come from the model's raw distribution, before penalties,
    temperature and truncation (see `engine.sampling.sampler`). `token` and `top_tokens`
    are the texts of the chosen and the top tokens, each decoded alone (a token holding
    part of a character shows U+FFFD, as in OpenAI's API); the sampler leaves them empty
    and the sample that records the entry fills them, on the engine thread. `rank` is the
    token's 1-based rank in the distribution (1 + the tokens strictly more likely); only
    prompt logprobs carry it.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples.

    In the outputs the engine emits, `text`, `token_ids` and `logprobs` hold what the sample
    gained since the previous output of its request (deltas: streaming reads them as they
    are). `RequestOutput.add` accumulates them; `LLM.generate` returns accumulated outputs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

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
    # With `SamplingParams.prompt_logprobs`: one entry per prompt token, the first None;
    # whole, in exactly one output (the first after the prompt is computed), not a delta.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def copy(self) -> RequestOutput:
        """A copy to `add` later outputs to, sharing no list that `add` extends."""
        outputs = [
            replace(
                c,
                token_ids=list(c.token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs),
            )
            for c in self.outputs
        ]
        return replace(self, outputs=outputs)

    def add(self, later: RequestOutput) -> None:
        """Append a later output's deltas to this one, which then reads as the whole so far.

        O(size of `later`): the accumulated lists are extended in place, never copied.
        """
        for mine, theirs in zip(self.outputs, later.outputs, strict=True):
            mine.text += theirs.text
            mine.token_ids.extend(theirs.token_ids)
            if mine.logprobs is not None and theirs.logprobs is not None:
                mine.logprobs.extend(theirs.logprobs)
            mine.finish_reason = theirs.finish_reason
            mine.stop_reason = theirs.stop_reason
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        self.error = later.error
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
