"""The priority scheduling policy on hand-built workloads: admission by priority then
arrival, preemption of the lowest ranked, and a waiting request of a lower priority value
preempting for admission; fcfs on the same workloads for contrast."""

from __future__ import annotations

import random

import pytest

from cache.block_manager import BlockManager
from scheduler import Scheduler, SchedulingPolicy, SequenceStatus
from scheduler.scheduler import PriorityQueue
from tests.scheduler.fake_engine import FakeEngine, add_request


def make_engine(
    num_blocks: int, block_size: int, policy: SchedulingPolicy, *, max_num_seqs: int = 8
) -> FakeEngine:
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True, watermark=0.0)
    scheduler = Scheduler(
        manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy
    )
    return FakeEngine(scheduler, random.Random(0))


def prompt(length: int, start: int = 0) -> list[int]:
    return [(start + i) % 50 for i in range(length)]


def admission_order(engine: FakeEngine) -> list[str]:
    """The request ids in the order the scheduler first admitted them, run to the end."""
    order: list[str] = []
    while engine.scheduler.num_running or engine.scheduler.num_waiting:
        for item in engine.step().scheduled:
            if item.seq.request_id not in order:
                order.append(item.seq.request_id)
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("priority", ["d", "b", "e", "a", "c"]), ("fcfs", ["a", "b", "c", "d", "e"])],
)
def test_the_queue_admits_by_priority_then_arrival(
    policy: SchedulingPolicy, expected: list[str]
) -> None:
    # One sequence at a time, so the admission order is the queue's order.
    engine = make_engine(64, 4, policy, max_num_seqs=1)
    for i, (request_id, priority) in enumerate(zip("abcde", [5, 0, 5, -1, 0], strict=True)):
        add_request(engine.scheduler, request_id, prompt(6, start=10 * i), 3, priority=priority)
    assert [seq.request_id for seq in engine.scheduler.waiting()] == expected
    assert admission_order(engine) == expected


def test_equal_ranks_keep_the_order_they_were_queued_in() -> None:
    queue = PriorityQueue()
    engine = make_engine(8, 4, "priority")
    seqs = [seq for i in range(4) for seq in add_request(engine.scheduler, f"r{i}", [1], 1, n=2)]
    for seq in seqs:
        seq.arrival_time = 1.0  # a clock too coarse to tell them apart
        queue.add(seq)
    assert queue.sequences() == seqs


@pytest.mark.parametrize(("policy", "victim"), [("priority", "batch"), ("fcfs", "chat")])
def test_growth_preempts_the_highest_priority_value_not_the_newest(
    policy: SchedulingPolicy, victim: str
) -> None:
    # 8 blocks of 4 hold 32 tokens; two sequences growing to 8 + 20 tokens cannot both stay.
    # The batch request came first, so fcfs preempts the newer chat; priority the batch.
    engine = make_engine(8, 4, policy)
    (batch,) = add_request(engine.scheduler, "batch", prompt(8), max_tokens=20, priority=10)
    engine.step()
    (chat,) = add_request(engine.scheduler, "chat", prompt(8, start=20), 20, priority=0)
    preempted = []
    while engine.scheduler.num_running or engine.scheduler.num_waiting:
        preempted += [seq.request_id for seq in engine.step().preempted]
    assert preempted and set(preempted) == {victim}
    assert batch.num_output_tokens == chat.num_output_tokens == 20
    assert chat.finished_time is not None and batch.finished_time is not None
    assert (chat.finished_time < batch.finished_time) == (policy == "priority")


def test_a_waiting_request_of_a_lower_value_preempts_for_admission() -> None:
    # Two batch sequences fill the cache (4 of 4 blocks); chat arrives and cannot fit.
    engine = make_engine(4, 4, "priority")
    scheduler = engine.scheduler
    (old,) = add_request(scheduler, "old", prompt(7), max_tokens=2, priority=10)
    (new,) = add_request(scheduler, "new", prompt(7, start=10), max_tokens=2, priority=10)
    engine.step()
    assert scheduler.num_running == 2 and engine.manager.num_free_blocks == 0
    (chat,) = add_request(scheduler, "chat", prompt(7, start=20), max_tokens=3, priority=0)
    output = engine.step()
    # The newer of the two batch sequences makes room; chat is admitted in the next step,
    # ahead of it.
    assert output.preempted == [new] and [s.seq for s in output.scheduled] == [old]
    assert [seq.request_id for seq in scheduler.waiting()] == ["chat", "new"]
    assert [s.seq for s in engine.step().scheduled] == [chat, new]
    engine.run()
    assert chat.finish_reason == new.finish_reason == "length"
    assert chat.num_preemptions == old.num_preemptions == 0


@pytest.mark.parametrize("priority", [10, 11])
def test_equal_or_higher_values_wait_rather_than_preempt(priority: int) -> None:
    engine = make_engine(4, 4, "priority")
    scheduler = engine.scheduler
    for i in range(2):
        add_request(scheduler, f"r{i}", prompt(7, start=10 * i), max_tokens=2, priority=10)
    engine.step()
    (late,) = add_request(scheduler, "late", prompt(7, start=30), 2, priority=priority)
    output = engine.step()
    assert not output.preempted and late.status is SequenceStatus.WAITING
    engine.run()
    assert scheduler.num_preemptions == 0 and late.finish_reason == "length"


def test_a_full_set_of_sequences_makes_room_for_a_lower_value() -> None:
    # The cache has room; the sequence slots (max_num_seqs 2) do not.
    engine = make_engine(64, 4, "priority", max_num_seqs=2)
    scheduler = engine.scheduler
    batch = [add_request(scheduler, f"b{i}", prompt(5, 9 * i), 30, priority=3)[0] for i in range(2)]
    engine.step()
    (chat,) = add_request(scheduler, "chat", prompt(5, start=40), max_tokens=2, priority=1)
    assert engine.step().preempted == [batch[1]]
    assert chat in [s.seq for s in engine.step().scheduled]
    engine.run()
    assert chat.finished_time is not None
    assert all(
        seq.finished_time is not None and chat.finished_time < seq.finished_time for seq in batch
    )


def test_a_request_that_can_never_fit_preempts_nothing() -> None:
    engine = make_engine(4, 4, "priority")
    scheduler = engine.scheduler
    (batch,) = add_request(scheduler, "batch", prompt(7), max_tokens=4, priority=10)
    engine.step()
    (huge,) = add_request(scheduler, "huge", prompt(40, start=5), max_tokens=1, priority=0)
    output = engine.step()
    assert output.rejected == [huge] and not output.preempted
    engine.run()
    assert batch.finish_reason == "length" and batch.num_preemptions == 0


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority"):
        Scheduler(
            BlockManager(4, 4),
            max_num_seqs=1,
            max_num_batched_tokens=4,
            policy="lifo",  # type: ignore[arg-type]
        )
