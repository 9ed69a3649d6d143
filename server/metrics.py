"""Prometheus metrics, in a registry per app so that several apps can share a process.

Engine gauges and counters are read from `llm.stats()` at scrape time, so they can never
disagree with the engine; latency histograms are observed by the server when a request
finishes, from the timestamps in its `RequestOutput.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats
    from engine.outputs import RequestOutput

PREFIX = "pagedserve_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineStatsCollector(Collector):
    """Exports one `EngineStats` snapshot per scrape; nothing while no engine is loaded."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        gauges = {
            "num_requests_running": ("Requests being computed.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_waiting),
            "kv_cache_usage_ratio": ("Fraction of KV-cache blocks in use (0..1).", stats.kv_usage),
            "kv_cache_used_blocks": ("KV-cache blocks held by requests.", stats.used_kv_blocks),
            "kv_cache_blocks": ("KV-cache blocks in total.", stats.num_kv_blocks),
            "kv_cache_cached_free_blocks": (
                "Free KV-cache blocks that still hold a prefix a later request can reuse.",
                stats.cached_free_kv_blocks,
            ),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, documentation, value=value)
        counters = {
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            "prefix_cache_hits": (
                "Prompt tokens served from the prefix cache.",
                stats.prefix_cache_hits,
            ),
            "prefix_cache_evictions": (
                "Cached prefix blocks dropped because their block was taken for new use.",
                stats.prefix_cache_evictions,
            ),
            "prompt_tokens": (
                "Prompt tokens computed or served from the cache.",
                stats.prompt_tokens_total,
            ),
            "generation_tokens": ("Tokens generated.", stats.generation_tokens_total),
            "num_preemptions": ("Requests preempted for lack of KV blocks.", stats.num_preemptions),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, documentation, value=value)


class ServerMetrics:
    """The app's registry: the engine collector plus per-request latency histograms."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Record a finished request's latencies (all n samples decode side by side)."""
        times = output.metrics
        if times.finished_time is None:
            return
        self.e2e_request_latency.observe(times.finished_time - times.arrival_time)
        if times.first_token_time is None:
            return
        self.time_to_first_token.observe(times.first_token_time - times.arrival_time)
        longest = max(len(completion.token_ids) for completion in output.outputs)
        if longest > 1:
            decode_time = times.finished_time - times.first_token_time
            self.time_per_output_token.observe(decode_time / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
