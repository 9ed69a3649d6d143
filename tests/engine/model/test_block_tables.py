"""The runner's block tables, kept from the scheduler's outputs alone, match the block
manager's at every step: through admissions, growth, preemptions, finishes and aborts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine import LLM, SamplingParams
from engine.model.runner import ModelRunner
from engine.model.step_inputs import BlockTables
from scheduler import ScheduledSequence, SchedulerOutput, Sequence
from tests.support.greedy import (
    MAX_TOKENS,
    TINY_BLOCK_BYTES,
    engine_greedy,
)


def _item(seq_id: str, new_blocks: list[int]) -> ScheduledSequence:
    return ScheduledSequence(Sequence(seq_id, seq_id, [1], 1), 1, 0, True, new_blocks)


def test_rows_follow_new_blocks_and_freed_sequences() -> None:
    tables = BlockTables(max_num_seqs=2, max_blocks_per_seq=4)
    tables.update(SchedulerOutput([_item("a", [5, 6]), _item("b", [7])]))
    tables.update(SchedulerOutput([_item("a", []), _item("b", [2, 9])]))
    a, b = tables.row("a"), tables.row("b")
    assert tables.table[a].tolist() == [5, 6, 0, 0] and tables.lengths[a] == 2
    assert tables.table[b].tolist() == [7, 2, 9, 0] and tables.lengths[b] == 3
    # A freed sequence's row is cleared before the step's admissions take rows.
    tables.update(SchedulerOutput([_item("a", [3])], freed=["a", "b"]))
    assert tables.table[tables.row("a")].tolist() == [3, 0, 0, 0]
    assert int(np.count_nonzero(tables.table)) == 1


def test_a_mirror_that_follows_the_drained_changes_matches_every_step() -> None:
    tables = BlockTables(max_num_seqs=3, max_blocks_per_seq=6, track_changes=True)
    mirror = np.full_like(tables.table, -1)  # what a device copy would hold
    steps = [
        SchedulerOutput([_item("a", [5, 6]), _item("b", [7])]),
        SchedulerOutput([_item("a", [1]), _item("b", [])]),
        # b is freed and c takes its row in the same step; then a grows again.
        SchedulerOutput([_item("c", [8, 9, 10]), _item("a", [2])], freed=["b"]),
        SchedulerOutput([_item("c", [11])], freed=["a"]),
        SchedulerOutput([_item("d", [3])]),
    ]
    for batch in steps:
        tables.update(batch)
        flat, ids = tables.drain_changes()
        mirror.reshape(-1)[flat] = ids
        for seq_id in (item.seq.seq_id for item in batch.scheduled):
            row, length = tables.row(seq_id), tables.lengths[tables.row(seq_id)]
            assert mirror[row, :length].tolist() == tables.blocks(seq_id)
    assert tables.drain_changes()[0].size == 0
    untracked = BlockTables(max_num_seqs=1, max_blocks_per_seq=2)
    untracked.update(SchedulerOutput([_item("a", [4])]))
    assert untracked.drain_changes()[0].size == 0


def test_engine_tables_match_the_block_manager_every_step(tiny_model_paths: dict[str, Path]):
    # 40 blocks of 4 tokens: the requests below run out of blocks and preempt each other.
    llm = LLM(
        str(tiny_model_paths["llama"]), dtype="float32", block_size=4, max_model_len=128,
        kv_cache_memory=40 * TINY_BLOCK_BYTES, max_num_batched_tokens=24,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    for i in range(6):
        engine.add_request(f"r{i}", engine.processor.from_prompt(f"prompt {i} " * (i + 2), params))
    manager, tables = engine.scheduler.block_manager, engine.runner.block_tables
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 10:
            engine.abort_request("r1")
        # Freed sequences leave the runner at the next step's update, so compare the
        # sequences that hold blocks in both.
        for seq_id in manager._seqs.keys() & tables._rows.keys():
            row = tables.row(seq_id)
            kept = tables.table[row, : tables.lengths[row]].tolist()
            assert kept == manager.block_table(seq_id), f"step {steps}: {seq_id}"
        assert manager._seqs.keys() <= tables._rows.keys()
    assert engine.stats().num_preemptions > 0
    engine.step()  # an empty step still delivers the last frees
    assert not tables._rows and int(np.count_nonzero(tables.table)) == 0


def test_an_engine_on_a_mirror_of_the_block_tables_matches_generate(
    tiny_model_paths,
    references,
):
    """The runner path of a GPU, whose block tables follow the host's by changed entries,
    run on the CPU: the same greedy tokens as `generate()`, through preemption."""
    llm = LLM(
        str(tiny_model_paths["llama"]), dtype="float32", block_size=4, max_model_len=264,
        kv_cache_memory=70 * TINY_BLOCK_BYTES,
    )  # fmt: skip
    engine = llm.engine
    runner = engine.runner
    engine.runner = ModelRunner(
        runner.model, runner.kv_caches, 4, engine.config.max_num_seqs, engine.max_model_len,
        mirror_block_tables=True,
    )  # fmt: skip
    assert engine.runner._device_tables.data_ptr() != engine.runner.block_tables.table.ctypes.data
    (prompts, expected), _ = references["llama"]
    assert engine_greedy(llm, prompts, MAX_TOKENS) == expected
    assert engine.stats().num_preemptions > 0
