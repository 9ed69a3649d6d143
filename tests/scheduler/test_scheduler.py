"""Scheduler behaviour on hand-built workloads, driven by a fake model step."""

from __future__ import annotations

import random

import pytest

import cache.block
from cache.block_manager import BlockManager
from scheduler import Scheduler, Sequence, SequenceStatus
from tests.scheduler.fake_engine import FakeEngine, add_request


def make_engine(
    num_blocks: int,
    block_size: int,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    seed: int = 0,
) -> FakeEngine:
    manager = BlockManager(
        num_blocks, block_size, enable_prefix_caching=enable_prefix_caching, watermark=0.0
    )
    scheduler = Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    return FakeEngine(scheduler, random.Random(seed))


def prompt(length: int, start: int = 0) -> list[int]:
    return [(start + i) % 50 for i in range(length)]


def assert_all_blocks_free(manager: BlockManager) -> None:
    assert manager.stats().used_blocks == 0
    assert manager.num_free_blocks == manager.num_blocks


def scheduled_ids(engine: FakeEngine) -> list[str]:
    return [s.seq.seq_id for s in engine.step().scheduled]


def test_random_workload_respects_budgets_and_finishes_everything() -> None:
    engine = make_engine(64, 4, max_num_seqs=4, max_num_batched_tokens=32)
    rng = random.Random(1)
    seqs = [
        seq
        for i in range(30)
        for seq in add_request(
            engine.scheduler,
            f"r{i}",
            prompt(rng.randint(1, 100), start=rng.randrange(50)),
            max_tokens=rng.randint(1, 30),
        )
    ]
    engine.run()  # FakeEngine checks both budgets and the K/V of every step
    for seq in seqs:
        assert seq.finish_reason == "length"
        assert seq.num_output_tokens == seq.max_tokens
    assert_all_blocks_free(engine.manager)


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue() -> None:
    engine = make_engine(400, 16, max_num_batched_tokens=512)
    (short,) = add_request(engine.scheduler, "short", prompt(10), max_tokens=100)
    engine.step()
    (long,) = add_request(engine.scheduler, "long", prompt(4000, start=7), max_tokens=5)

    chunks = []
    while long.num_output_tokens == 0:
        outputs_before = short.num_output_tokens
        output = engine.step()
        decode, chunk = output.scheduled
        assert decode.seq is short and decode.num_new_tokens == 1
        assert short.num_output_tokens == outputs_before + 1
        assert chunk.seq is long
        chunks.append((chunk.num_new_tokens, chunk.samples))

    assert [n for n, _ in chunks] == [511] * 7 + [4000 - 7 * 511]
    assert [samples for _, samples in chunks] == [False] * 7 + [True]
    engine.run()
    assert long.num_output_tokens == 5 and short.num_output_tokens == 100


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    engine = make_engine(64, 4, max_num_batched_tokens=64, enable_chunked_prefill=False)
    (first,) = add_request(engine.scheduler, "first", prompt(8), max_tokens=3)
    assert scheduled_ids(engine) == ["first"]
    (whole,) = add_request(engine.scheduler, "whole", prompt(64, start=10), max_tokens=2)
    # 63 tokens are left beside first's decode: not enough for all 64.
    assert scheduled_ids(engine) == ["first"]
    assert scheduled_ids(engine) == ["first"]
    assert first.finish_reason == "length"
    output = engine.step()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in output.scheduled] == [("whole", 64)]
    engine.run()
    assert whole.num_output_tokens == 2


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected() -> None:
    engine = make_engine(64, 4, max_num_batched_tokens=64, enable_chunked_prefill=False)
    (too_long,) = add_request(engine.scheduler, "too-long", prompt(65), max_tokens=2)
    (fine,) = add_request(engine.scheduler, "fine", prompt(20), max_tokens=2)
    output = engine.step()
    assert output.rejected == [too_long]
    assert too_long.finish_reason == "error"
    assert too_long.error is not None and "max_num_batched_tokens" in too_long.error
    assert [s.seq for s in output.scheduled] == [fine]
    engine.run()
    assert fine.finish_reason == "length"
    assert_all_blocks_free(engine.manager)


def test_newest_is_preempted_when_blocks_run_out_and_later_finishes_in_full() -> None:
    # 8 blocks of 4 hold 32 tokens; two sequences growing to 8 + 20 tokens each cannot
    # both stay.
    engine = make_engine(8, 4)
    (old,) = add_request(engine.scheduler, "old", prompt(8), max_tokens=20)
    (new,) = add_request(engine.scheduler, "new", prompt(8, start=20), max_tokens=20)
    preempted_with: list[int] = []
    while engine.scheduler.num_running or engine.scheduler.num_waiting:
        outputs_before = list(new.output_token_ids)
        output = engine.step()
        if output.preempted:
            assert output.preempted == [new]
            assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
            assert new not in [s.seq for s in output.scheduled]
            assert new.output_token_ids == outputs_before
            preempted_with = outputs_before
    assert engine.scheduler.num_preemptions >= 1 and new.num_preemptions >= 1
    assert old.num_preemptions == 0
    assert preempted_with and new.output_token_ids[: len(preempted_with)] == preempted_with
    assert old.num_output_tokens == new.num_output_tokens == 20
    assert_all_blocks_free(engine.manager)


def test_the_newest_sequence_preempts_itself_and_waits_at_the_front() -> None:
    engine = make_engine(4, 4)
    (old,) = add_request(engine.scheduler, "old", prompt(7), max_tokens=3)
    (new,) = add_request(engine.scheduler, "new", prompt(8, start=10), max_tokens=3)
    (later,) = add_request(engine.scheduler, "later", prompt(1, start=30), max_tokens=3)
    assert scheduled_ids(engine) == ["old", "new"]  # 4 of 4 blocks in use
    # new's first decode needs a third block; it is the newest, so it makes way itself.
    output = engine.step()
    assert [s.seq for s in output.scheduled] == [old] and output.preempted == [new]
    assert engine.scheduler.num_waiting == 2 and engine.scheduler.num_running == 1
    engine.run()
    assert new.first_token_time is not None and later.first_scheduled_time is not None
    assert new.num_output_tokens == 3 and new.finish_reason == "length"
    assert later.finish_reason == "length"
    assert_all_blocks_free(engine.manager)


def test_abort_frees_blocks_of_waiting_running_and_mid_prefill_sequences() -> None:
    engine = make_engine(64, 4, max_num_batched_tokens=16)
    scheduler = engine.scheduler
    (running,) = add_request(scheduler, "running", prompt(4), max_tokens=50)
    engine.step()
    (prefilling,) = add_request(scheduler, "prefilling", prompt(40), max_tokens=5)
    (waiting,) = add_request(scheduler, "waiting", prompt(10), max_tokens=5)
    siblings = add_request(scheduler, "siblings", prompt(6), max_tokens=5, n=2)
    output = engine.step()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in output.scheduled] == [
        ("running", 1),
        ("prefilling", 15),
    ]
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens

    assert scheduler.abort("prefilling") == [prefilling]
    assert scheduler.abort("waiting") == [waiting]
    assert scheduler.abort("running") == [running]
    assert scheduler.abort("siblings") == siblings
    assert scheduler.abort("running") == [] and scheduler.abort("unknown") == []
    for seq in [prefilling, waiting, running, *siblings]:
        assert seq.is_finished and seq.finish_reason == "abort"
        assert seq.finished_time is not None
    assert not (scheduler.num_running or scheduler.num_waiting)
    assert scheduler.num_waiting == scheduler.num_running == 0
    assert_all_blocks_free(engine.manager)


def test_a_request_that_can_never_fit_is_rejected_without_disturbing_others() -> None:
    engine = make_engine(8, 4)
    (before,) = add_request(engine.scheduler, "before", prompt(10), max_tokens=4)
    (huge,) = add_request(engine.scheduler, "huge", prompt(40), max_tokens=1)
    (after,) = add_request(engine.scheduler, "after", prompt(10, start=25), max_tokens=4)
    output = engine.step()
    assert output.rejected == [huge]
    assert huge.finish_reason == "error" and huge.num_output_tokens == 0
    assert huge.error is not None and "blocks" in huge.error
    assert [s.seq for s in output.scheduled] == [before, after]
    engine.run()
    assert before.num_output_tokens == after.num_output_tokens == 4
    assert_all_blocks_free(engine.manager)


def test_a_head_that_must_wait_is_not_overtaken() -> None:
    engine = make_engine(8, 4)
    add_request(engine.scheduler, "first", prompt(20), max_tokens=4)
    (head,) = add_request(engine.scheduler, "head", prompt(16, start=20), max_tokens=4)
    (small,) = add_request(engine.scheduler, "small", prompt(4, start=40), max_tokens=4)
    # first holds 5 blocks; head needs 4 of the 3 left, so small (1 block) must wait too.
    assert scheduled_ids(engine) == ["first"]
    assert head.status is SequenceStatus.WAITING and small.status is SequenceStatus.WAITING
    engine.run()
    assert head.first_scheduled_time is not None and small.first_scheduled_time is not None
    assert head.first_scheduled_time <= small.first_scheduled_time
    assert head.num_output_tokens == small.num_output_tokens == 4


def test_parallel_samples_share_the_prompt_blocks_in_the_same_step() -> None:
    engine = make_engine(32, 4)
    seqs = add_request(engine.scheduler, "req", prompt(10), max_tokens=6, n=3)
    output = engine.step()
    # The first sample computes the prompt; the others hit its 2 full blocks (the
    # block holding the last prompt token is never shared) and compute only the rest.
    assert [s.num_new_tokens for s in output.scheduled] == [10, 2, 2]
    assert [seq.num_cached_tokens for seq in seqs] == [0, 8, 8]
    tables = [engine.manager.block_table(seq.seq_id) for seq in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({table[2] for table in tables}) == 3
    assert engine.manager.stats().used_blocks == 2 + 3
    engine.run()
    assert all(seq.num_output_tokens == 6 for seq in seqs)
    assert_all_blocks_free(engine.manager)


def test_a_budget_smaller_than_a_block_still_makes_progress() -> None:
    engine = make_engine(16, 16, max_num_batched_tokens=3)
    (seq,) = add_request(engine.scheduler, "req", prompt(50), max_tokens=4)
    engine.run(max_steps=100)
    assert engine.steps == 17 + 3  # ceil(50 / 3) prefill steps, then 3 decodes
    assert seq.num_output_tokens == 4


def test_max_num_seqs_caps_the_running_set() -> None:
    engine = make_engine(64, 4, max_num_seqs=2)
    seqs = [add_request(engine.scheduler, f"r{i}", prompt(5, i), max_tokens=3)[0] for i in range(5)]
    assert scheduled_ids(engine) == ["r0", "r1"]
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 3
    engine.run()
    assert all(seq.num_output_tokens == 3 for seq in seqs)


def test_timestamps_follow_the_sequence_lifecycle() -> None:
    engine = make_engine(16, 4)
    (seq,) = add_request(engine.scheduler, "req", prompt(6), max_tokens=2)
    assert seq.first_scheduled_time is None
    engine.run()
    assert seq.first_scheduled_time is not None and seq.first_token_time is not None
    assert seq.finished_time is not None
    assert seq.arrival_time <= seq.first_scheduled_time <= seq.first_token_time
    assert seq.first_token_time <= seq.finished_time


def test_misuse_fails_loudly() -> None:
    engine = make_engine(16, 4)
    scheduler = engine.scheduler
    (seq,) = add_request(scheduler, "req", prompt(6), max_tokens=2)
    with pytest.raises(ValueError, match="already scheduled"):
        add_request(scheduler, "req", prompt(6), max_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add(Sequence("empty", "empty", [], max_tokens=1))
    output = scheduler.schedule()
    scheduler.update(output, [1])
    with pytest.raises(RuntimeError, match="update"):
        scheduler.update(output, [1])
    scheduler.finish(seq, "stop")
    with pytest.raises(ValueError, match="not an unfinished"):
        scheduler.finish(seq, "stop")
    with pytest.raises(ValueError):
        Scheduler(engine.manager, max_num_seqs=0, max_num_batched_tokens=8)


def test_each_block_of_a_sequence_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head that waits for blocks for several steps and a sequence that grows by
    decoding each hash every one of their full blocks once (the scheduler keeps the
    hashes on the sequence)."""
    hashed: list[tuple[int | None, tuple[int, ...]]] = []
    original = cache.block.hash_block

    def counting(parent: int | None, tokens: list[int]) -> int:
        hashed.append((parent, tuple(tokens)))
        return original(parent, tokens)

    monkeypatch.setattr(cache.block, "hash_block", counting)
    engine = make_engine(12, 4, max_num_seqs=2, max_num_batched_tokens=64)
    (running,) = add_request(engine.scheduler, "running", prompt(36), max_tokens=8)
    engine.step()
    (waiting,) = add_request(engine.scheduler, "waiting", prompt(20, start=7), max_tokens=4)
    for _ in range(5):  # 10 of 12 blocks are taken: the head must wait every step
        engine.step()
        assert waiting.status is SequenceStatus.WAITING
    engine.run()
    assert running.num_output_tokens == 8 and waiting.num_output_tokens == 4
    assert len(hashed) == len(set(hashed)), "a block was hashed twice"
    assert len(hashed) <= running.num_tokens // 4 + waiting.num_tokens // 4
