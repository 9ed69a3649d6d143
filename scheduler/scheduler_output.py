"""What one `Scheduler.schedule()` call decided: the batch of one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass(slots=True, frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: it computes positions
    `[num_computed_tokens, num_computed_tokens + num_new_tokens)` of `seq.token_ids`.

    Both counts are fixed at schedule time, so they stay right after `update()` advances
    the sequence. `samples` is true when this chunk reaches the sequence's last token: the
    model then samples one new token from the chunk's last position. `new_block_ids` are
    the blocks this step appended to the sequence's block table: its whole table when it
    was admitted in this step, else the blocks it grew by (usually none), so a runner that
    keeps block tables across steps applies them without asking the block manager.
    """

    seq: Sequence
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool
    new_block_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds the model for this sequence."""
        return self.seq.get_token_ids(
            self.num_computed_tokens, self.num_computed_tokens + self.num_new_tokens
        )


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
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
