"""A stand-in for LLMEngine: drives a Scheduler with random tokens instead of a model.

It keeps a fake KV cache (one token id per slot) written through each sequence's block
table, so a step that reads another sequence's K/V, a block table too short for its
chunk, or a prefix hit on the wrong tokens shows up as a mismatch.
"""

from __future__ import annotations

import random

from cache.block_manager import BlockManager
from scheduler import Scheduler, SchedulerOutput, Sequence
from scheduler.scheduler import priority_rank


def add_request(
    scheduler: Scheduler,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    n: int = 1,
    priority: int = 0,
) -> list[Sequence]:
    """Add a request's sequences the way the engine does (seq_id per sample when n > 1)."""
    seqs = [
        Sequence(
            seq_id=request_id if n == 1 else f"{request_id}-{index}",
            request_id=request_id,
            prompt_token_ids=list(prompt),
            max_tokens=max_tokens,
            index=index,
            priority=priority,
        )
        for index in range(n)
    ]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """The invariants every step's batch must hold, whatever the workload."""
    manager = scheduler.block_manager
    assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    assert scheduler.num_running <= scheduler.max_num_seqs
    scheduled_ids = [s.seq.seq_id for s in output.scheduled]
    assert len(set(scheduled_ids)) == len(scheduled_ids)
    assert not {seq.seq_id for seq in output.preempted} & set(scheduled_ids)
    if scheduler.policy == "priority" and output.preempted:
        # Victims are the lowest ranked: every sequence still running ranks at or above them.
        lowest_kept = max(map(priority_rank, scheduler.running()), default=None)
        assert lowest_kept is None or lowest_kept <= min(map(priority_rank, output.preempted))
    for seq in output.rejected:
        assert seq.finish_reason == "error" and seq.error
        assert seq.seq_id not in scheduled_ids
    for s in output.scheduled:
        end = s.num_computed_tokens + s.num_new_tokens
        assert s.num_new_tokens >= 1
        assert end <= s.seq.num_tokens
        assert s.samples == (end == s.seq.num_tokens)
        assert len(manager.block_table(s.seq.seq_id)) * manager.block_size >= end
        if not scheduler.enable_chunked_prefill:
            assert s.samples, "without chunked prefill every chunk runs to the end"


class FakeEngine:
    """Schedules, "runs" the step, samples random tokens and finishes at max_tokens.

    Invariants checked every step: the block tables rebuilt from the outputs alone (each
    output's `freed`, then its `new_block_ids`, as a model runner keeps them) equal the block
    manager's; after the step's writes, each scheduled sequence reads back exactly its own
    tokens at positions [0, end) through its block table.
    """

    def __init__(self, scheduler: Scheduler, rng: random.Random, vocab_size: int = 50) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.vocab_size = vocab_size
        self.kv: dict[int, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.steps = 0

    @property
    def manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        check_output(self.scheduler, output)
        for seq_id in output.freed:
            del self.tables[seq_id]
        for s in output.scheduled:
            self.tables.setdefault(s.seq.seq_id, []).extend(s.new_block_ids)
            assert self.tables[s.seq.seq_id] == self.manager.block_table(s.seq.seq_id)
        for s in output.scheduled:
            slots = self._slots(s.seq.seq_id, s.num_computed_tokens + s.num_new_tokens)
            self.kv.update(zip(slots[s.num_computed_tokens :], s.token_ids, strict=True))
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            seen = [self.kv.get(slot) for slot in self._slots(s.seq.seq_id, end)]
            assert seen == s.seq.get_token_ids(0, end), f"{s.seq.seq_id} reads wrong K/V"
        sampling = output.sampling
        self.scheduler.update(output, [self.rng.randrange(self.vocab_size) for _ in sampling])
        for s in sampling:
            if s.seq.num_output_tokens >= s.seq.max_tokens:
                self.scheduler.finish(s.seq, "length")
        self.steps += 1
        return output

    def run(self, max_steps: int = 10_000) -> None:
        """Step until nothing is left; fail rather than loop forever."""
        while self.scheduler.num_running or self.scheduler.num_waiting:
            assert self.steps < max_steps, "scheduler made no progress"
            self.step()

    def _slots(self, seq_id: str, num_tokens: int) -> list[int]:
        """The cache slots of positions [0, num_tokens) through the block table."""
        block_size = self.manager.block_size
        table = self.tables[seq_id]
        return [table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
