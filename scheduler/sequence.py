"""A sequence of tokens being generated (its prompt, output and progress), and its share
of one engine step as `Scheduler.schedule()` decides it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    # Admitted, its blocks held, waiting for some of them to be loaded from a KV tier.
    LOADING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """The state of one generated sequence; a request with n > 1 samples owns n of them,
    with `seq_id` f"{request_id}-{index}" (or just `request_id` when n == 1).

    Invariants:
    - `seq_id` is unique among unfinished sequences; it keys the block table in the
      block manager, which holds blocks for this sequence exactly while it is RUNNING or
      LOADING.
    - `0 <= num_computed_tokens <= num_tokens`: the first `num_computed_tokens` of
      `token_ids` (prompt, then output) have K/V in the cache. A WAITING sequence has none,
      including one that was preempted: it keeps its output and recomputes all of it.
    - `finish_reason` is set exactly when `status` is FINISHED.
    - `priority` orders the sequence under the priority scheduling policy, a lower value
      first (vLLM's meaning); the FCFS policy ignores it.
    - A sequence with `prompt_logprobs` takes no prefix-cache hits: every prompt position
      runs through the model, whose logits there give the next prompt token's logprob
      (its blocks still fill the cache for others).
    - `checkpoint_positions` are token counts of the prompt where its conversation's turns
      end (ascending): a hybrid model keeps its recurrent state there, as at the prompt's
      end, so a later request that shares the conversation up to one resumes from it.
    - `block_hashes` holds the chained prefix-cache hashes of the first full blocks of
      `token_ids` (see `cache.extend_block_hashes`); the block manager extends it as it
      needs more, so each block of the sequence is hashed once in its life. A sequence of
      a LoRA adapter runs in its `lora_slot` (-1: the base model) and its hashes are a
      `cache.BlockHashes` chained onto the adapter's root.
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
    checkpoint_positions: tuple[int, ...] = ()
    lora_slot: int = -1
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


@dataclass(slots=True, frozen=True)
class StateStep:
    """What a hybrid model's recurrent layers do with one scheduled chunk's state: start
    from the state in slot `source` (the sequence's live `slot`; on the first chunk after a
    prefix hit, the checkpoint it resumes from; -1 at position 0: an empty state), leave
    the chunk's final state in `slot`, and copy the state after the first p tokens of the
    sequence into slot s for each `(p, s)` of `checkpoints` (positions within the chunk)."""

    slot: int
    source: int
    checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: it computes positions
    `[num_computed_tokens, num_computed_tokens + num_new_tokens)` of `seq.token_ids`
    followed by `draft_token_ids`.

    Both counts are fixed at schedule time, so they stay right after `update()` advances
    the sequence. `samples` is true when this chunk reaches the sequence's last token: the
    model then samples one new token from the chunk's last position. `draft_token_ids`
    (speculative decoding; only on a sampling chunk of one token) are proposed tokens fed
    after the sequence's last one, so that the step also samples at each of their
    positions: `num_new_tokens` counts them, and the chunk's last `num_draft_tokens + 1`
    positions sample. They are no part of `seq.token_ids` until verified. `new_block_ids` are
    the blocks this step appended to the sequence's block table: its whole table when it
    was admitted in this step, else the blocks it grew by (usually none), so a runner that
    keeps block tables across steps applies them without asking the block manager.
    `state` is set for a hybrid model's sequences (see `StateStep`).
    """

    seq: Sequence
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool
    new_block_ids: list[int]
    draft_token_ids: tuple[int, ...] = ()
    state: StateStep | None = None

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_sequence_tokens(self) -> int:
        """The tokens of `seq.token_ids` this step computes (`num_new_tokens` less drafts)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """The positions this chunk samples at: 0, or 1 plus one per draft token."""
        return len(self.draft_token_ids) + 1 if self.samples else 0

    @property
    def num_prompt_logprob_rows(self) -> int:
        """The chunk's first positions whose logits give a prompt token's logprob (the
        next one's): for a sequence with `prompt_logprobs`, those before the prompt's last
        position (whose logits sample the first output token). A chunk recomputed after a
        preemption has them again."""
        if not self.seq.prompt_logprobs:
            return 0
        start = self.num_computed_tokens
        end = min(start + self.num_sequence_tokens, self.seq.num_prompt_tokens - 1)
        return max(end - start, 0)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds the model for this sequence, drafts last."""
        tokens = self.seq.get_token_ids(
            self.num_computed_tokens, self.num_computed_tokens + self.num_sequence_tokens
        )
        return tokens + list(self.draft_token_ids) if self.draft_token_ids else tokens


@dataclass(slots=True, frozen=True)
class TierLoad:
    """Blocks of `seq` to load from a KV tier: `block_ids[i]` takes the KV of the block
    whose hash is `block_hashes[i]`, the sequence's block `first_block + i`. `epoch` is
    the sequence's `num_preemptions` when the load began: a load that finishes after its
    sequence was preempted (or finished) is dropped."""

    seq: Sequence
    first_block: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    epoch: int

    @property
    def current(self) -> bool:
        """Whether the sequence still waits for this load (its blocks are still its own)."""
        return self.seq.status is SequenceStatus.LOADING and self.seq.num_preemptions == self.epoch

    def expected_blocks(self, block_size: int) -> list[ExpectedBlock]:
        """What each block of the load must hold: its hash, its parent's, its tokens (a
        tier checks a copy against these before it serves it)."""
        seq, first = self.seq, self.first_block
        parent = seq.block_hashes[first - 1] if first else None
        expected = []
        for index, block_hash in enumerate(self.block_hashes):
            start = (first + index) * block_size
            tokens = tuple(seq.get_token_ids(start, start + block_size))
            expected.append(ExpectedBlock(block_hash, parent, tokens))
            parent = block_hash
        return expected


@dataclass(slots=True, frozen=True)
class ExpectedBlock:
    """A block a tier load must find: `token_ids` after the prefix `parent_hash` names."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch and its side effects.

    Invariants: `scheduled` holds each sequence at most once, running sequences first (in
    admission order) then newly admitted ones; `num_batched_tokens <= max_num_batched_tokens`
    and `len(scheduled) <= max_num_seqs`. No sequence in `preempted` or `rejected` is in
    `scheduled`. Rejected sequences are already FINISHED with reason "error". `freed` lists,
    in order, the sequence ids whose blocks were freed since the previous `schedule()`
    (finished, aborted, or preempted, in this step too): a block table kept outside the
    block manager drops these before it applies `scheduled`'s `new_block_ids`.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    loads: list[TierLoad] = field(default_factory=list)

    @property
    def sampling(self) -> list[ScheduledSequence]:
        """The scheduled sequences that sample a token this step, in batch order."""
        return [item for item in self.scheduled if item.samples]

    @property
    def num_sampled_rows(self) -> int:
        """The positions the step samples at: one per sampling sequence plus its drafts."""
        return sum(s.num_sampled_rows for s in self.scheduled)

    @property
    def num_prompt_logprob_rows(self) -> int:
        """The positions whose logits give prompt logprobs, after the sampled ones."""
        return sum(s.num_prompt_logprob_rows for s in self.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
