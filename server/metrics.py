"""Prometheus metrics, in a registry per app so that several apps can share a process.

Engine gauges and counters are read from `llm.stats()` at scrape time, so they can never
disagree with the engine; latency histograms are observed by the server when a request
finishes, from the timestamps in its `RequestOutput.metrics`.

Every series of a model is labelled `model_name` with its served name, as vLLM labels its
own. The series that vLLM also reports are exported a second time under vLLM's names
(`VLLM_TWINS`), so that dashboards and autoscalers written for vLLM work unchanged. A twin
is a renamed copy of its pagedserve family from the same scrape, never a separate
measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.snapshot import EngineStats
    from engine.speculative.speculator import SpeculationStats

PREFIX = "pagedserve_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# A pagedserve family (less PREFIX) -> the vLLM (v1) family that reports the same quantity.
# Counters are named without `_total`, which the exposition adds to both. vLLM's
# per-request mean time per output token is pagedserve's; its per-token inter-token
# latency histogram has no pagedserve equivalent.
VLLM_TWINS = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries",
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "num_preemptions": "vllm:num_preemptions",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}


class EngineStatsCollector(Collector):
    """Exports each loaded model's `EngineStats` per scrape, its samples labelled
    `model_name`; nothing while no model is loaded."""

    def __init__(self, stats: Callable[[], Sequence[tuple[str, EngineStats]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model_name, stats in self._stats():
            for family in _engine_families(stats):
                into = merged.setdefault(
                    family.name,
                    Metric(family.name, family.documentation, family.type, family.unit),
                )
                into.samples += [
                    sample._replace(labels={"model_name": model_name} | sample.labels)
                    for sample in family.samples
                ]
        yield from merged.values()


def _engine_families(stats: EngineStats) -> Iterator[Metric]:
    """One engine's families, unlabelled by model."""
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
        "sleep_level": ("0 while awake, else the level the engine sleeps at.", stats.sleep_level),
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
    if stats.speculation is not None:
        yield from _speculation_counters(stats.speculation)
    if stats.tier is not None:
        yield from _tier_metrics(stats)


def _tier_metrics(stats: EngineStats) -> Iterator[Metric]:
    """The KV tier's (only while one is on): the external prefix cache's queries and hits
    under vLLM's names, and the tier's bytes, blocks, stores, loads, drops and load time."""
    tier = stats.tier
    assert tier is not None
    yield CounterMetricFamily(
        PREFIX + "external_prefix_cache_queries",
        "Prompt tokens of requests that looked in the KV tier.",
        value=stats.external_prefix_cache_queries,
    )
    yield CounterMetricFamily(
        PREFIX + "external_prefix_cache_hits",
        "Prompt tokens loaded from the KV tier.",
        value=stats.external_prefix_cache_hits,
    )
    counters = {
        "kv_tier_stores": ("KV blocks written to the tier.", tier.stores),
        "kv_tier_loads": ("KV blocks loaded from the tier.", tier.loads),
        "kv_tier_drops": (
            "Tier blocks found damaged, truncated or foreign, deleted and computed again.",
            tier.drops,
        ),
    }
    for name, (documentation, value) in counters.items():
        counter = CounterMetricFamily(PREFIX + name, documentation, labels=["medium"])
        counter.add_metric([tier.medium], value)
        yield counter
    for name, (documentation, value) in {
        "kv_tier_used_bytes": ("Bytes the KV tier's blocks take.", tier.bytes_used),
        "kv_tier_capacity_bytes": ("The KV tier's budget in bytes.", tier.capacity),
        "kv_tier_blocks": ("KV blocks the tier holds.", tier.num_blocks),
    }.items():
        gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=["medium"])
        gauge.add_metric([tier.medium], value)
        yield gauge
    yield _load_seconds(tier.load_count, tier.load_seconds, tier.medium)


def _load_seconds(count: int, total: float, medium: str) -> Metric:
    family = SummaryMetricFamily(
        PREFIX + "kv_tier_load_seconds",
        "Time from a tier load's start to its blocks being read and checked.",
        labels=["medium"],
    )
    family.add_metric([medium], count_value=count, sum_value=total)
    return family


def _speculation_counters(stats: SpeculationStats) -> Iterator[Metric]:
    """Speculative decoding's counters, vLLM's `spec_decode_*` (only while it is on)."""
    counters = {
        "spec_decode_num_drafts": ("Verifications of a draft.", stats.num_drafts),
        "spec_decode_num_draft_tokens": ("Draft tokens proposed.", stats.num_draft_tokens),
        "spec_decode_num_accepted_tokens": (
            "Draft tokens accepted: each one a step saved.",
            stats.num_accepted_tokens,
        ),
    }
    for name, (documentation, value) in counters.items():
        yield CounterMetricFamily(PREFIX + name, documentation, value=value)
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft (0: the first).",
        labels=["position"],
    )
    for position, value in enumerate(stats.accepted_per_position):
        per_position.add_metric([str(position)], value)
    yield per_position


class PriorityCollector(Collector):
    """Exports the unfinished sequences by model, status and priority, one sample per
    priority that has sequences now (`LLMEngine.sequences_by_priority`); pagedserve's own,
    with no vLLM twin. Under the fcfs policy every sequence has priority 0."""

    def __init__(
        self, by_priority: Callable[[], Sequence[tuple[str, dict[str, dict[int, int]]]]]
    ) -> None:
        self._by_priority = by_priority

    def collect(self) -> Iterator[Metric]:
        counts = self._by_priority()
        if not counts:
            return
        for status, documentation in (
            ("running", "Sequences being computed, by request priority."),
            ("waiting", "Sequences waiting to be scheduled, by request priority."),
        ):
            family = GaugeMetricFamily(
                f"{PREFIX}num_requests_{status}_by_priority",
                documentation,
                labels=["model_name", "priority"],
            )
            for model_name, by_status in counts:
                for priority, count in sorted(by_status[status].items()):
                    family.add_metric([model_name, str(priority)], count)
            yield family


class VllmTwinCollector(Collector):
    """Exports the families of `sources`, each one named in `VLLM_TWINS` followed by its
    twin: the same samples (labelled `model_name` already) under vLLM's name.

    Invariant: a twin is copied from the family object exported beside it, so within a
    scrape the two carry equal values. No twin of a family without samples (no model
    loaded, or no request yet).
    """

    def __init__(self, sources: Sequence[Collector]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                yield family
                twin_name = VLLM_TWINS.get(family.name.removeprefix(PREFIX))
                if twin_name is not None and family.samples:
                    yield _renamed(family, twin_name)


def _renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` named `name`; each sample keeps its suffix (`_total`, `_bucket`,
    `_count`, `_sum`, `_created`)."""
    twin = Metric(name, family.documentation, family.type, family.unit)
    twin.samples = [
        sample._replace(name=name + sample.name.removeprefix(family.name))
        for sample in family.samples
    ]
    return twin


class _Latencies(Collector):
    """The latency histograms, each with a series (empty at first) for every loaded model,
    as vLLM exports its own from start-up."""

    def __init__(self, histograms: Sequence[Histogram], loaded: Callable[[], list[str]]) -> None:
        self._histograms = histograms
        self._loaded = loaded

    def collect(self) -> Iterator[Metric]:
        names = self._loaded()
        for histogram in self._histograms:
            for name in names:
                histogram.labels(name)
            yield from histogram.collect()


class ServerMetrics:
    """The app's registry: the engine's series and per-request latency histograms, each
    with its vLLM twin once a model is loaded (see `VllmTwinCollector`)."""

    def __init__(
        self,
        stats: Callable[[], Sequence[tuple[str, EngineStats]]],
        by_priority: Callable[[], Sequence[tuple[str, dict[str, dict[int, int]]]]],
    ) -> None:
        """`stats` gives each loaded model's name and engine snapshot, `by_priority` its
        name and sequences by status and priority."""
        self.registry = CollectorRegistry()
        # The histograms join no registry by themselves: the twin collector exports them.
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From arrival to the first generated token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            ["model_name"],
            buckets=TPOT_BUCKETS,
            registry=None,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From arrival to the last token.",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=None,
        )
        latencies = _Latencies(
            (self.time_to_first_token, self.time_per_output_token, self.e2e_request_latency),
            lambda: [name for name, _ in stats()],
        )
        self.registry.register(VllmTwinCollector([EngineStatsCollector(stats), latencies]))
        self.registry.register(PriorityCollector(by_priority))
        # Admission control (server/admission.py); pagedserve's own, with no vLLM twin.
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests refused with a 429 because too many sequences were queued.",
            registry=self.registry,
        )
        self.requests_timed_out = Counter(
            PREFIX + "requests_timed_out",
            "Requests failed with a 504 because their deadline passed, queued or running.",
            registry=self.registry,
        )

    def observe_first_token(self, model_name: str, output: RequestOutput) -> None:
        """Record a request's TTFT when its first token arrives (as vLLM does), so requests
        still streaming, or abandoned later, count too; call once per request."""
        times = output.metrics
        if times.first_token_time is not None:
            ttft = times.first_token_time - times.arrival_time
            self.time_to_first_token.labels(model_name).observe(ttft)

    def observe_finished(self, model_name: str, output: RequestOutput) -> None:
        """Record a finished request's end-to-end latency and its mean time per output token
        (all n samples decode side by side)."""
        times = output.metrics
        if times.finished_time is None:
            return
        e2e = times.finished_time - times.arrival_time
        self.e2e_request_latency.labels(model_name).observe(e2e)
        if times.first_token_time is None:
            return
        longest = max(len(completion.token_ids) for completion in output.outputs)
        if longest > 1:
            decode_time = times.finished_time - times.first_token_time
            tpot = decode_time / (longest - 1)
            self.time_per_output_token.labels(model_name).observe(tpot)

    def first_tokens(self, model_name: str) -> tuple[float, float]:
        """The number of `model_name`'s TTFT observations and their sum, as a scrape reads
        them; (0, 0) before its first."""
        [family] = self.time_to_first_token.collect()
        values = {
            sample.name: sample.value
            for sample in family.samples
            if sample.labels.get("model_name") == model_name
        }
        return values.get(family.name + "_count", 0.0), values.get(family.name + "_sum", 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
