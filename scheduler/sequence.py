"""One sequence of tokens being generated: its prompt, its output and its progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """The state of one generated sequence; a request with n > 1 samples owns n of them,
    with `seq_id` f"{request_id}-{index}" (or just `request_id` when n == 1).

    Invariants:
    - `seq_id` is unique among unfinished sequences; it keys the block table in the
      block manager, which holds blocks for this sequence exactly while it is RUNNING.
    - `0 <= num_computed_tokens <= num_tokens`: the first `num_computed_tokens` of
      `token_ids` (prompt, then output) have K/V in the cache. A WAITING sequence has none,
      including one that was preempted: it keeps its output and recomputes all of it.
    - `finish_reason` is set exactly when `status` is FINISHED.
    - `priority` orders the sequence under the priority scheduling policy, a lower value
      first (vLLM's meaning); the FCFS policy ignores it.
    - A sequence with `prompt_logprobs` takes no prefix-cache hits: every prompt position
      runs through the model, whose logits there give the next prompt token's logprob
      (its blocks still fill the cache for others).
    - `block_hashes` holds the chained prefix-cache hashes of the first full blocks of
      `token_ids` (see `cache.extend_block_hashes`); the block manager extends it as it
      needs more, so each block of the sequence is hashed once in its life.
    """

    seq_id: str
    request_id: str
    prompt_token_ids: list[int]
    # The engine stops the sequence at this many output tokens; the scheduler never reads it.
    max_tokens: int
    index: int = 0
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_computed_tokens: int = 0
    # Tokens served from the prefix cache at the latest admission (a preempted sequence is
    # admitted again and may hit its own freed blocks).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: bool = False
    block_hashes: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output, as a new list (the block manager hashes and matches these)."""
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
