"""From an OpenAI request to `SamplingParams`: one mapping for completions and chat."""

from __future__ import annotations

from engine.sampling.params import SamplingParams
from server.protocol import SamplingRequest

# Request fields that carry over to SamplingParams under the same name.
_SHARED_FIELDS = (
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
)


def sampling_params(
    request: SamplingRequest, *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """Fields left out or null keep SamplingParams' defaults; raises ValueError naming the
    parameter when a value is out of range."""
    given = {name: getattr(request, name) for name in _SHARED_FIELDS}
    values = {name: value for name, value in given.items() if value is not None}
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)
