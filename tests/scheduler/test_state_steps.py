"""A hybrid model's recurrent state through the scheduler: each chunk's source and slot,
the checkpoints it writes at turn starts, the prompt's end and where another prompt
parted, a later request resuming from one, and every slot back when all is done."""

from __future__ import annotations

from cache import BlockManager, StatePool
from scheduler import Scheduler, Sequence, StateStep


def _scheduler(slots: int = 8, budget: int = 6) -> Scheduler:
    manager = BlockManager(32, 4, watermark=0.0, state_pool=StatePool(slots))
    return Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=budget)


def _run_step(scheduler: Scheduler) -> list[tuple[str, StateStep]]:
    output = scheduler.schedule()
    scheduler.update(output, [1] * len(output.sampling))
    states = []
    for item in output.scheduled:
        assert item.state is not None
        states.append((item.seq.seq_id, item.state))
    for item in output.sampling:
        scheduler.finish(item.seq, "stop")
    return states


def test_chunks_read_and_leave_their_state_and_write_checkpoints() -> None:
    scheduler = _scheduler()
    pool = scheduler.block_manager.state_pool
    assert pool is not None
    seq = Sequence("a", "a", list(range(10)), max_tokens=1, checkpoint_positions=(5,))
    scheduler.add(seq)
    ((_, first),) = _run_step(scheduler)  # tokens 0-5: a turn starts at 5, floored to 4
    assert first.source == -1 and [p for p, _ in first.checkpoints] == [4]
    ((_, second),) = _run_step(scheduler)  # tokens 6-9: the last token is 9, floored to 8
    assert second.source == second.slot == first.slot
    assert [p for p, _ in second.checkpoints] == [8]
    assert pool.num_live == 0 and pool.num_checkpoints == 2  # finished: its slot is free

    # The same prompt again resumes from the checkpoint after its second block.
    scheduler.add(Sequence("b", "b", list(range(10)), max_tokens=1))
    ((_, resumed),) = _run_step(scheduler)
    assert resumed.source == second.checkpoints[0][1]
    assert resumed.checkpoints == ()  # its checkpoints exist already
    assert seq.num_cached_tokens == 0


def test_where_a_prompt_parted_from_a_cached_one_gets_a_checkpoint() -> None:
    scheduler = _scheduler(budget=32)
    scheduler.add(Sequence("a", "a", list(range(14)), max_tokens=1))
    _run_step(scheduler)
    # Shares two blocks with "a", whose only checkpoint is before its last token (12):
    # computed whole, it leaves a checkpoint at 8, where the cache's blocks ran out.
    parted = Sequence("b", "b", [*range(8), 50, 51, 52], max_tokens=1)
    scheduler.add(parted)
    ((_, state),) = _run_step(scheduler)
    assert parted.num_cached_tokens == 0 and [p for p, _ in state.checkpoints] == [8]
    third = Sequence("c", "c", [*range(8), 60, 61, 62], max_tokens=1)
    scheduler.add(third)
    _run_step(scheduler)
    assert third.num_cached_tokens == 8
