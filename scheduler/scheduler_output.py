"""What one `Scheduler.schedule()` call decided: the batch of one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


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
    """

    seq: Sequence
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool
    new_block_ids: list[int]
    draft_token_ids: tuple[int, ...] = ()

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
