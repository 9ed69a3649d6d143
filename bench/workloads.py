"""Fixed, seeded benchmark workloads: prompts as token ids, identical for every engine.

Prompts are random ids drawn from the ordinary vocabulary (special and added tokens are
left out), so no engine sees chat markers or end-of-sequence ids in its input.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests that all arrive at once; request `i` generates exactly `output_lens[i]`
    tokens (end of sequence ignored). Invariant: one positive output length per prompt."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.output_lens) != len(self.prompts) or min(self.output_lens, default=1) < 1:
            raise ValueError("need one positive output length per prompt")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def output_len(self) -> int | None:
        """The output length every request shares; None when the lengths differ."""
        lengths = set(self.output_lens)
        return lengths.pop() if len(lengths) == 1 else None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)


def ordinary_token_ids(vocab_size: int, excluded: Iterable[int]) -> list[int]:
    """Every id below `vocab_size` except `excluded` (special and added tokens)."""
    skip = set(excluded)
    return [token for token in range(vocab_size) if token not in skip]


def random_workload(
    num_requests: int,
    min_prompt: int,
    max_prompt: int,
    output_len: int,
    token_ids: Sequence[int],
    seed: int = 0,
    max_output_len: int | None = None,
) -> Workload:
    """Prompts of uniformly random length in [min_prompt, max_prompt], random ids; every
    request generates `output_len` tokens, or with `max_output_len` a uniformly random
    length in [output_len, max_output_len]. Output lengths are drawn after every prompt, so
    the prompts of a seed do not depend on them (and W1's are those of earlier versions)."""
    if not 0 < min_prompt <= max_prompt:
        raise ValueError(f"need 0 < min_prompt <= max_prompt, got {min_prompt}, {max_prompt}")
    rng = random.Random(seed)
    prompts = [
        rng.choices(token_ids, k=rng.randint(min_prompt, max_prompt)) for _ in range(num_requests)
    ]
    if max_output_len is None:
        output_lens = [output_len] * num_requests
    else:
        if not 0 < output_len <= max_output_len:
            raise ValueError(
                f"need 0 < output_len <= max_output_len, got {output_len}, {max_output_len}"
            )
        output_lens = [rng.randint(output_len, max_output_len) for _ in range(num_requests)]
    return Workload("random", prompts, output_lens)


def shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    tail_len: int,
    output_len: int,
    token_ids: Sequence[int],
    seed: int = 0,
) -> Workload:
    """One common `prefix_len`-token system prompt followed by a distinct `tail_len`-token
    question per request."""
    rng = random.Random(seed)
    prefix = rng.choices(token_ids, k=prefix_len)
    prompts = [prefix + rng.choices(token_ids, k=tail_len) for _ in range(num_requests)]
    return Workload("shared-prefix", prompts, [output_len] * num_requests)
