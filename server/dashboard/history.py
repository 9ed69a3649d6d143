"""The dashboard's time series: the engine's rates and levels once a second over the last
five minutes, in a ring buffer that a task beside the app fills (`install` registers it in the
server state's `background`).

Every sample is a difference of the counters /metrics exports (the engine's `stats()` and
the server's TTFT histogram), read the way a scrape reads them: on the event loop, each
value an atomic read of a counter the engine thread keeps, so values within one sample
may straddle a step. Memory is bounded by the buffer's length (`WINDOW / INTERVAL`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.snapshot import EngineStats

INTERVAL = 1.0  # seconds between samples
WINDOW = 300.0  # seconds of samples kept


@dataclass(slots=True, frozen=True)
class Sample:
    """The interval that ended at `time` (Unix seconds), since the sample before it.

    `generation_tokens_per_s` is the interval's mean. `time_to_first_token` is the mean
    TTFT in seconds of the requests whose first token came in the interval (the TTFT
    histogram is observed at a request's first token), None if none did;
    `prefix_cache_hit_rate` is the fraction of the prompt tokens looked up in the interval
    that the prefix cache served, None if none were. `running`, `waiting` (sequences) and
    `kv_usage` (0..1) are read at `time`.
    """

    time: float
    generation_tokens_per_s: float
    time_to_first_token: float | None
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_hit_rate: float | None


@dataclass(slots=True, frozen=True)
class _Counters:
    monotonic: float
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    ttft_count: float
    ttft_sum: float


class StatsHistory:
    """The last `window / interval` samples, oldest first.

    Invariants: each sample covers the time since the counters were read before it, and
    never a time without an engine: the first read once the engine is loaded only sets
    the baseline. While no engine is loaded nothing is recorded.
    """

    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        ttft: Callable[[], tuple[float, float]],
        interval: float = INTERVAL,
        window: float = WINDOW,
    ) -> None:
        """`stats` is the engine's snapshot (None until loaded), `ttft` the count and sum of
        the times to first token the server observed."""
        self.interval = interval
        self.window = window
        self._stats = stats
        self._ttft = ttft
        self._samples: deque[Sample] = deque(maxlen=round(window / interval))
        self._last: _Counters | None = None

    def samples(self) -> list[Sample]:
        return list(self._samples)

    def record(self, monotonic: float, wall: float) -> None:
        """Read the counters at `monotonic` (Unix time `wall`), later than the previous
        read, and append the sample since that read if there was one."""
        stats = self._stats()
        if stats is None:
            self._last = None
            return
        ttft_count, ttft_sum = self._ttft()
        now = _Counters(
            monotonic,
            stats.generation_tokens_total,
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            ttft_count,
            ttft_sum,
        )
        last, self._last = self._last, now
        if last is None:
            return
        elapsed = monotonic - last.monotonic
        first_tokens = now.ttft_count - last.ttft_count
        queries = now.prefix_queries - last.prefix_queries
        hits = now.prefix_hits - last.prefix_hits
        self._samples.append(
            Sample(
                time=wall,
                generation_tokens_per_s=(now.generation_tokens - last.generation_tokens) / elapsed,
                time_to_first_token=(now.ttft_sum - last.ttft_sum) / first_tokens
                if first_tokens
                else None,
                running=stats.num_running,
                waiting=stats.num_waiting,
                kv_usage=stats.kv_usage,
                prefix_cache_hit_rate=hits / queries if queries else None,
            )
        )

    async def run(self) -> None:
        """Record every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.record(time.monotonic(), time.time())
