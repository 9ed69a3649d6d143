"""The `speculative_config` setting: vLLM's keys and meaning, n-gram (prompt lookup) only."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM's value for both n-gram bounds when neither is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(BaseModel):
    """Speculative decoding by prompt lookup, as vLLM's `{"method": "ngram", ...}`.

    `prompt_lookup_min`..`prompt_lookup_max` bound the length of the n-gram looked up: the
    context's last n tokens, longest n first, are searched for earlier in the context and
    the tokens that followed that occurrence are proposed, at most
    `num_speculative_tokens`. As in vLLM, one bound given alone sets the other and neither
    given means 5. `disable_by_batch_size` (vLLM's name): speculation steps aside while
    more sequences than this run, since a forward over many sequences' drafts costs more
    than it saves. Invariant: `1 <= prompt_lookup_min <= prompt_lookup_max`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"]
    num_speculative_tokens: int = Field(gt=0, le=64)
    prompt_lookup_max: int = Field(gt=0, le=64)
    prompt_lookup_min: int = Field(gt=0, le=64)
    disable_by_batch_size: int = Field(4, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _one_bound_sets_the_other(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        return values | {
            "prompt_lookup_min": high if low is None else low,
            "prompt_lookup_max": low if high is None else high,
        }

    @model_validator(mode="after")
    def _bounds_in_order(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self
