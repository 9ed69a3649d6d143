"""The interfaces through which the core speaks to a grammar engine: one sample's
constraint on its next token, and the compiler that makes constraints and masks logits.

The grammar component (`engine.grammar`, llguidance's matchers, chosen by
`engine.capabilities.grammar_compiler`) implements both; the core (intake, request state,
sampler, speculative decoding) names only these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.sampling.params import StructuredOutputs


class LogitsConstraint(Protocol):
    """One sample's grammar state. Invariant: it has consumed exactly the sample's output
    tokens so far (verification consumes draft tokens on a `deep_copy` only)."""

    def consume_token(self, token: int) -> bool:
        """Advance past `token`; False if the grammar forbids it."""
        ...

    def consume_tokens(self, tokens: list[int]) -> bool:
        """Advance past each of `tokens` in turn; False if the grammar forbids one."""
        ...

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows, without advancing."""
        ...

    def is_stopped(self) -> bool:
        """Whether the grammar allows nothing more (the sample ends)."""
        ...

    def deep_copy(self) -> LogitsConstraint:
        """An independent copy in the same state."""
        ...


class ConstraintCompiler(Protocol):
    """Turns a request's `StructuredOutputs` into constraints for one model's tokenizer.
    Thread-safe: `compile` runs on the intake thread, the rest on the engine's."""

    def compile(self, spec: StructuredOutputs, prompt_token_ids: Sequence[int] = ()) -> str:
        """The grammar of a reply to the prompt, validated against the tokenizer; raises
        ValueError naming what the grammar engine refused."""
        ...

    def matcher(self, grammar: str) -> LogitsConstraint:
        """A fresh constraint at the start of `grammar` (from `compile`)."""
        ...

    def mask_logits(
        self, logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[LogitsConstraint]
    ) -> None:
        """Set to -inf, in place, every logit of row `rows[i]` that `constraints[i]`
        forbids next."""
        ...
