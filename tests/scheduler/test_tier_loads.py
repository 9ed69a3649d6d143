"""The scheduler over a KV tier: a prefix lookup that stops in memory goes on in the tier,
the sequence waits LOADING without holding up others, and its block table reaches the
runner in its first step."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cache import BlockManager, extend_block_hashes, held_prefix
from scheduler import Scheduler, Sequence, SequenceStatus

BLOCK = 4


class SetTier:
    """A tier that holds exactly the hashes in `held` (the scheduler asks no more of it)."""

    def __init__(self, held: set[int]) -> None:
        self.held = held

    def lookup(self, block_hashes: Seq[int]) -> int:
        return held_prefix(block_hashes, self.held)


def hashes_of(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    return hashes


def make(tier: SetTier, num_blocks: int = 32) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK, watermark=0.0, record_registered=True)
    return Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, tier=tier)


def seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, seq_id, list(tokens), max_tokens=4)


def test_a_sequence_loads_what_the_tier_holds_and_others_run_meanwhile() -> None:
    prompt = list(range(18))  # 4 full blocks before the last token's block
    tier = SetTier(set(hashes_of(prompt)[:3]))
    scheduler = make(tier)
    loading, other = seq("a", prompt), seq("b", [90, 91, 92])
    scheduler.add(loading)
    scheduler.add(other)
    out = scheduler.schedule()
    [load] = out.loads
    assert load.seq is loading and load.first_block == 0 and len(load.block_ids) == 3
    assert loading.status is SequenceStatus.LOADING
    assert [item.seq for item in out.scheduled] == [other]  # the other one runs now
    assert scheduler.tier_queries == len(prompt) + 3  # both looked

    scheduler.update(out, [7])
    scheduler.loaded(load, 2)  # the third block's file turned out damaged
    assert loading.status is SequenceStatus.RUNNING
    assert loading.num_computed_tokens == loading.num_cached_tokens == 2 * BLOCK
    assert scheduler.tier_hits == 2 * BLOCK
    out = scheduler.schedule()
    first = next(item for item in out.scheduled if item.seq is loading)
    assert first.num_computed_tokens == 2 * BLOCK
    # Its first step hands the runner its whole table, loaded blocks included.
    assert first.new_block_ids == scheduler.block_manager.block_table("a")
    assert first.new_block_ids[:3] == list(load.block_ids)
    # The loaded blocks are registered in memory: the next request hits them there.
    registered = [block.block_hash for block in scheduler.block_manager.take_registered()]
    assert hashes_of(prompt)[:2] == registered[:2]


def test_a_load_goes_on_from_where_memory_hits_stop() -> None:
    prompt = list(range(21))
    scheduler = make(SetTier(set(hashes_of(prompt))))
    scheduler.tier = None  # the first pass computes and registers every block
    first = seq("a", prompt)
    scheduler.add(first)
    out = scheduler.schedule()
    scheduler.update(out, [1])
    scheduler.finish(first, "stop")
    scheduler.tier = SetTier(set(hashes_of(prompt)))
    again = seq("b", prompt)
    scheduler.add(again)
    out = scheduler.schedule()
    assert not out.loads  # everything is still in memory: nothing to load
    assert again.num_cached_tokens == 20


def test_a_load_finished_after_its_sequence_was_aborted_or_preempted_is_ignored() -> None:
    prompt = list(range(18))
    scheduler = make(SetTier(set(hashes_of(prompt))))
    loading = seq("a", prompt)
    scheduler.add(loading)
    out = scheduler.schedule()
    [load] = out.loads
    scheduler.abort("a")
    assert not load.current
    scheduler.loaded(load, 4)
    assert loading.is_finished and scheduler.tier_hits == 0
    # The runner never saw its table, so no step names it freed.
    assert "a" not in scheduler.schedule().freed
    assert scheduler.block_manager.num_free_blocks == 32


def test_a_preempted_loading_sequence_loads_again_when_admitted_again() -> None:
    prompt = list(range(18))
    scheduler = make(SetTier(set(hashes_of(prompt))), num_blocks=6)
    loading = seq("a", prompt)
    scheduler.add(loading)
    [old] = scheduler.schedule().loads
    scheduler._preempt(loading)  # as a newer victim would be, to let an older one grow
    assert loading.status is SequenceStatus.WAITING and not old.current
    [new] = scheduler.schedule().loads
    assert new.current and new.epoch == old.epoch + 1
    scheduler.loaded(old, 4)
    assert loading.status is SequenceStatus.LOADING  # the stale load changed nothing
    scheduler.loaded(new, 4)
    assert loading.num_computed_tokens == 16


def test_without_reuse_the_tier_is_not_asked() -> None:
    prompt = list(range(18))
    scheduler = make(SetTier(set(hashes_of(prompt))))
    logprobs = seq("a", prompt)
    logprobs.prompt_logprobs = True
    scheduler.add(logprobs)
    out = scheduler.schedule()
    assert not out.loads and out.scheduled[0].seq is logprobs
