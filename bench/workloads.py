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
    """Requests that all arrive at once; each generates exactly `output_len` tokens."""

    name: str
    prompts: list[list[int]]
    output_len: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return self.num_requests * self.output_len

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
) -> Workload:
    """W1: prompts of uniformly random length in [min_prompt, max_prompt], random ids."""
    if not 0 < min_prompt <= max_prompt:
        raise ValueError(f"need 0 < min_prompt <= max_prompt, got {min_prompt}, {max_prompt}")
    rng = random.Random(seed)
    prompts = [
        rng.choices(token_ids, k=rng.randint(min_prompt, max_prompt)) for _ in range(num_requests)
    ]
    return Workload("random", prompts, output_len)


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
    return Workload("shared-prefix", prompts, output_len)
