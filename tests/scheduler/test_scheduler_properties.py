"""Random arrivals, lengths, priorities, aborts and tiny caches, under either scheduling
policy: everything ends, nothing leaks, and admission follows the policy's order."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from cache.block_manager import BlockManager
from scheduler import SCHEDULING_POLICIES, Scheduler, SchedulingPolicy, Sequence, SequenceStatus
from scheduler.scheduler import priority_rank
from tests.scheduler.fake_engine import FakeEngine, add_request

# Prompts start with a prefix of one of these, so requests often share cached blocks.
FAMILIES = [[random.Random(f).randrange(50) for _ in range(24)] for f in range(3)]
MAX_STEPS = 5_000


@dataclass(slots=True)
class Arrival:
    request_id: str
    step: int
    prompt: list[int]
    max_tokens: int
    n: int
    abort_step: int | None
    priority: int


@st.composite
def arrivals(draw: st.DrawFn) -> list[Arrival]:
    result = []
    for i in range(draw(st.integers(1, 10))):
        family = FAMILIES[draw(st.integers(0, len(FAMILIES) - 1))]
        prefix = family[: draw(st.integers(0, len(family)))]
        tail = draw(st.lists(st.integers(0, 49), max_size=8))
        result.append(
            Arrival(
                request_id=f"r{i}",
                step=draw(st.integers(0, 15)),
                prompt=(prefix + tail) or [7],
                max_tokens=draw(st.integers(1, 16)),
                n=draw(st.integers(1, 3)),
                abort_step=draw(st.none() | st.integers(0, 40)),
                priority=draw(st.integers(-1, 2)),
            )
        )
    return result


@settings(max_examples=150, deadline=None)
@given(
    requests=arrivals(),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(2, 32),
    watermark=st.sampled_from([0.0, 0.1, 0.3]),
    enable_prefix_caching=st.booleans(),
    enable_chunked_prefill=st.booleans(),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 48),
    seed=st.integers(0, 3),
    policy=st.sampled_from(SCHEDULING_POLICIES),
)
def test_every_request_ends_and_every_block_comes_back(
    requests: list[Arrival],
    block_size: int,
    num_blocks: int,
    watermark: float,
    enable_prefix_caching: bool,
    enable_chunked_prefill: bool,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    seed: int,
    policy: SchedulingPolicy,
) -> None:
    manager = BlockManager(
        num_blocks, block_size, enable_prefix_caching=enable_prefix_caching, watermark=watermark
    )
    scheduler = Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
    )
    engine = FakeEngine(scheduler, random.Random(seed))
    seqs: dict[str, list[Sequence]] = {}
    step = 0
    while len(seqs) < len(requests) or (scheduler.num_running or scheduler.num_waiting):
        assert step < MAX_STEPS, "a request starved"
        for arrival in requests:
            if arrival.step == step:
                seqs[arrival.request_id] = add_request(
                    scheduler, arrival.request_id, arrival.prompt, arrival.max_tokens, arrival.n,
                    arrival.priority,
                )  # fmt: skip
            if arrival.abort_step == step:
                scheduler.abort(arrival.request_id)
        if scheduler.num_running or scheduler.num_waiting:
            waiting = scheduler.waiting()
            engine.step()
            check_admission_order(waiting, policy)
        step += 1

    usable_blocks = num_blocks - int(watermark * num_blocks)
    for arrival in requests:
        # The most a sequence ever holds: prompt and all outputs but the last, which stops it.
        peak_tokens = len(arrival.prompt) + arrival.max_tokens - 1
        always_fits = math.ceil(peak_tokens / block_size) <= usable_blocks and (
            enable_chunked_prefill or peak_tokens <= max_num_batched_tokens
        )
        for seq in seqs[arrival.request_id]:
            assert seq.is_finished
            if seq.finish_reason == "length":
                assert seq.num_output_tokens == arrival.max_tokens
            elif seq.finish_reason == "abort":
                assert arrival.abort_step is not None
            else:
                assert seq.finish_reason == "error" and seq.error
                assert not always_fits, f"{seq.seq_id} rejected though it fits: {seq.error}"
                cannot_fit_now = math.ceil(seq.num_tokens / block_size) > usable_blocks or (
                    not enable_chunked_prefill and seq.num_tokens > max_num_batched_tokens
                )
                assert cannot_fit_now, f"{seq.seq_id} rejected for a false reason: {seq.error}"

    stats = manager.stats()
    assert stats.used_blocks == 0
    assert manager.num_free_blocks == stats.free_blocks == num_blocks
    assert scheduler.num_waiting == scheduler.num_running == 0


def check_admission_order(waiting: list[Sequence], policy: SchedulingPolicy) -> None:
    """A step admits (or rejects) from the front of the queue as it stood (`waiting`, in
    its order): no sequence still waiting after the step was ahead of one that left it. The queue's
    order is arrival (fcfs) or priority then arrival (priority), preempted ones aside."""
    left = [i for i, seq in enumerate(waiting) if seq.status is not SequenceStatus.WAITING]
    still_waiting = [i for i, seq in enumerate(waiting) if seq.status is SequenceStatus.WAITING]
    if left and still_waiting:
        assert max(left) < min(still_waiting)
    fresh = [seq for seq in waiting if not seq.num_preemptions]
    if policy == "priority":
        ranks = [priority_rank(seq) for seq in waiting]
        assert ranks == sorted(ranks)
    else:
        arrivals = [seq.arrival_time for seq in fresh]
        assert arrivals == sorted(arrivals)
