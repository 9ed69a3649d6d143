"""Draft tokens in the scheduler: they ride after a decoding sequence's own token within
the budgets, never preempt and never enter the prefix cache unverified."""

from __future__ import annotations

from cache.block_manager import BlockManager
from scheduler import Scheduler, SchedulerOutput, Sequence

BLOCK = 4


def make_scheduler(num_blocks: int = 16, max_num_batched_tokens: int = 64) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True, watermark=0.0)
    return Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens)


def decoding(scheduler: Scheduler, **prompts: list[int]) -> list[Sequence]:
    """Sequences whose prompts are computed, in one step, and whose first token (7) is
    sampled."""
    seqs = [Sequence(seq_id, seq_id, prompt, max_tokens=100) for seq_id, prompt in prompts.items()]
    for seq in seqs:
        scheduler.add(seq)
    step = scheduler.schedule()
    scheduler.update(step, [7] * len(step.sampling))
    return seqs


def registered(scheduler: Scheduler) -> list[tuple[int, ...]]:
    """The token ids of every block the prefix cache holds."""
    return sorted(block.token_ids for block in scheduler.block_manager._cached.values())


def test_a_draft_rides_after_the_sequences_own_token() -> None:
    scheduler = make_scheduler()
    (seq,) = decoding(scheduler, a=[1, 2, 3, 4, 5, 6])  # tokens: 1..6, 7
    step = scheduler.schedule({"a": [8, 9, 10]})
    (item,) = step.scheduled
    assert item.draft_token_ids == (8, 9, 10)
    assert item.num_new_tokens == 4 and item.num_sampled_rows == 4
    assert item.token_ids == [7, 8, 9, 10]
    assert seq.num_tokens == 7  # drafts are no part of the sequence yet
    # Positions 6..9 need blocks 1 and 2: the draft's slots are held.
    assert len(scheduler.block_manager.block_table("a")) == 3


def test_verified_drafts_count_as_computed_and_only_they_are_hashed() -> None:
    scheduler = make_scheduler()
    (seq,) = decoding(scheduler, a=[1, 2, 3, 4, 5, 6])
    step = scheduler.schedule({"a": [8, 9, 10]})
    scheduler.update(step, [8])  # row 0 sampled the first draft token
    scheduler.accept_draft(seq, 9)  # row 1 sampled the second
    scheduler.accept_draft(seq, 11)  # row 2 sampled 11, not the draft's 10: stop here
    assert seq.output_token_ids == [7, 8, 9, 11]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 9
    # Block 1 (positions 4..7: 5, 6, 7, 8) is verified and registered; the draft's 10 at
    # position 9 is in no hash.
    assert registered(scheduler) == [(1, 2, 3, 4), (5, 6, 7, 8)]
    step = scheduler.schedule()
    (item,) = step.scheduled
    assert (item.num_computed_tokens, item.token_ids) == (9, [11])  # 10's slot is rewritten


def test_a_rejected_draft_leaves_no_trace_in_the_prefix_cache() -> None:
    scheduler = make_scheduler()
    decoding(scheduler, a=[1, 2, 3, 4, 5, 6])
    step = scheduler.schedule({"a": [8, 9, 10]})
    scheduler.update(step, [12])  # the first draft token refused
    assert registered(scheduler) == [(1, 2, 3, 4)]
    scheduler.finish(scheduler.running()[0], "stop")
    assert scheduler.block_manager.stats().used_blocks == 0


def test_drafts_fit_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    decoding(scheduler, a=[1, 2, 3], b=[4, 5, 6])
    step = scheduler.schedule({"a": [1, 1, 1, 1], "b": [2, 2, 2]})
    assert [item.draft_token_ids for item in step.scheduled] == [(1, 1, 1, 1), ()]
    assert step.num_batched_tokens == 6


def test_a_draft_never_preempts_and_leaves_each_running_sequence_a_block() -> None:
    # 6 blocks: a and b hold 2 each (6 tokens: a prompt of 5 and a sampled one); 2 free, each of the
    # two running sequences keeps one to grow by, so no draft slot may take a block.
    scheduler = make_scheduler(num_blocks=6)
    decoding(scheduler, a=[1, 2, 3, 4, 5], b=[11, 12, 13, 14, 15])
    step: SchedulerOutput = scheduler.schedule({"a": [9, 9, 9, 9, 9], "b": [9]})
    # Each one's block 1 holds positions 4..7: its own token at 5 and room for two drafts.
    assert [item.draft_token_ids for item in step.scheduled] == [(9, 9), (9,)]
    assert not step.preempted
    assert scheduler.block_manager.num_free_blocks == 2


def test_a_prefilling_sequence_gets_no_draft() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = Sequence("a", "a", list(range(10)), max_tokens=5)
    scheduler.add(seq)
    step = scheduler.schedule({"a": [1, 2]})
    assert step.scheduled[0].draft_token_ids == ()
