"""A consistent view of the engine between two steps: KV blocks, sequences, counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cache import BlockState
from engine.kv_tier import TierStats
from engine.speculative.speculator import SpeculationStats
from scheduler import SchedulingPolicy, Sequence, SequenceStatus

__all__ = ["BlockState", "EngineSnapshot", "EngineStats", "SequenceSnapshot"]


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics; token counts are totals since start. `speculation` is
    None when speculative decoding is off, `tier` when no KV tier is. The external prefix
    cache (vLLM's name for a tier below the KV tensor) counts, in tokens, the prompts that
    looked in the tier and what was loaded from it. `sleep_level`: 0 awake, else the level
    the engine sleeps at (engine/sleep.py)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    used_kv_blocks: int
    cached_free_kv_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    speculation: SpeculationStats | None = None
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    tier: TierStats | None = None
    sleep_level: int = 0  # 0: awake


@dataclass(slots=True, frozen=True)
class SequenceSnapshot:
    """One unfinished sequence (a sample of a request) at the snapshot's moment.

    `age` and `time_to_first_token` are seconds since the request arrived, the latter None
    until the sequence has sampled a token. A preempted sequence is waiting, keeps its
    output tokens and has `computed_tokens == 0`. `priority` is its request's (0 unless
    the engine schedules by priority).
    """

    seq_id: str
    request_id: str
    status: Literal["running", "waiting"]
    priority: int
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    computed_tokens: int
    cached_tokens: int
    preemptions: int
    age: float
    time_to_first_token: float | None

    @classmethod
    def of(cls, seq: Sequence, now: float) -> SequenceSnapshot:
        """`seq` (running or waiting) as it is at monotonic time `now`."""
        first_token = seq.first_token_time
        return cls(
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            status="waiting" if seq.status is SequenceStatus.WAITING else "running",
            priority=seq.priority,
            prompt_tokens=seq.num_prompt_tokens,
            output_tokens=seq.num_output_tokens,
            max_tokens=seq.max_tokens,
            computed_tokens=seq.num_computed_tokens,
            cached_tokens=seq.num_cached_tokens,
            preemptions=seq.num_preemptions,
            age=now - seq.arrival_time,
            time_to_first_token=None if first_token is None else first_token - seq.arrival_time,
        )


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine as one thread saw it between two steps, so its parts agree.

    Invariants: `len(block_map) == stats.num_kv_blocks`, one `BlockState` character per
    block by block id; its USED and SHARED characters number `stats.used_kv_blocks` and
    its CACHED ones `stats.cached_free_kv_blocks`. `sequences` holds the running sequences
    in admission order (`stats.num_running` of them), then the waiting ones in the order
    they will be admitted (`stats.num_waiting`). `scheduling_policy` is the order's.
    """

    stats: EngineStats
    scheduling_policy: SchedulingPolicy
    block_map: str
    sequences: tuple[SequenceSnapshot, ...]

    def block_counts(self) -> dict[BlockState, int]:
        """How many blocks are in each state; the counts sum to `stats.num_kv_blocks`."""
        return {state: self.block_map.count(state.value) for state in BlockState}
